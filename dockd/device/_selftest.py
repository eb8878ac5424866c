"""Multi-process checks of the collective bindings on a real device: used by tests/gpu and
scripts/gpu_check.py. NCCL on CUDA GPUs, or HCCL on Ascend NPUs (`backend="hccl"`, with torch_npu).

`run_ranks(op, world)` spawns `world` processes (torch.multiprocessing, spawn), rank 0 makes the
unique id and passes it through a queue, each rank runs `OPS[op]` on its own Communicator and
checks its results against the expected tensors; a failed check raises in the child and
`run_ranks` re-raises it. With fewer GPUs than ranks, ranks share GPUs
(each rank then claims a host of its own, `own_host_env`: NCCL refuses two ranks on one GPU
of one host, and they talk over its socket transport on loopback).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable

_DEVICE_TYPE = {"nccl": "cuda", "hccl": "npu"}


def device_module(kind: str):
    """torch.cuda, or torch.npu (registered by importing torch_npu)."""
    import torch

    if kind == "npu":
        import torch_npu  # noqa: F401

    return getattr(torch, kind)


def _sync(dev) -> None:
    device_module(dev.type).synchronize(dev)


def _sendrecv(comm, dev, n: int = 1 << 20) -> dict:
    import torch

    peer = 1 - comm.rank
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool):
        src = (torch.arange(n, device=dev) % 251).to(dtype)
        if comm.rank == 0:
            comm.send(src, peer)
        else:
            buf = torch.zeros_like(src)
            comm.recv(buf, peer)
            _sync(dev)
            assert torch.equal(buf, src), f"recv of {dtype}: data differs"
    _sync(dev)
    # both ways at once: needs a group, or the two blocking sends would deadlock
    mine = torch.full((n,), comm.rank + 1, dtype=torch.float32, device=dev)
    theirs = torch.zeros_like(mine)
    with comm.group():
        comm.send(mine, peer)
        comm.recv(theirs, peer)
    _sync(dev)
    assert torch.equal(theirs, torch.full_like(mine, peer + 1)), "grouped exchange: data differs"
    return {"ok": True}


def _broadcast(comm, dev, n: int = 1 << 20) -> dict:
    import torch

    for root in range(comm.world):
        expected = torch.arange(n, dtype=torch.float32, device=dev) * (root + 1)
        t = expected.clone() if comm.rank == root else torch.zeros_like(expected)
        comm.broadcast(t, root)
        _sync(dev)
        assert torch.equal(t, expected), f"broadcast from root {root}: data differs"
    return {"ok": True}


def _all_gather(comm, dev, n: int = 1 << 18) -> dict:
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        inp = (torch.arange(n, device=dev) + comm.rank * 1000).to(dtype)
        out = torch.empty(comm.world * n, dtype=dtype, device=dev)
        comm.all_gather(out, inp)
        _sync(dev)
        expected = torch.cat([(torch.arange(n, device=dev) + r * 1000).to(dtype) for r in range(comm.world)])
        assert torch.equal(out, expected), f"all_gather of {dtype}: data differs"
    return {"ok": True}


def _bandwidth(comm, dev, size_mib: int = 256, iters: int = 5) -> dict:
    """rank 0 sends `size_mib` MiB to rank 1 `iters` times; rank 0 also times a device-to-device copy."""
    import torch

    nbytes = size_mib << 20
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if comm.rank == 0:
        buf.copy_((torch.arange(nbytes, device=dev) % 253).to(torch.uint8))
    else:
        buf.zero_()
    _sync(dev)

    def one() -> None:
        if comm.rank == 0:
            comm.send(buf, 1)
        elif comm.rank == 1:
            comm.recv(buf, 0)

    one()   # warm-up (connection setup happens on the first transfer)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        one()
    _sync(dev)
    nccl_s = time.perf_counter() - t0
    out = {"bytes": nbytes, "iters": iters, "nccl_s": nccl_s, "nccl_gbps": nbytes * iters / nccl_s / 1e9}
    if comm.rank == 1:
        expected = (torch.arange(nbytes, device=dev) % 253).to(torch.uint8)
        assert torch.equal(buf, expected), "bandwidth transfer: data differs"
    if comm.rank == 0:
        dst = torch.empty_like(buf)
        dst.copy_(buf)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(buf)
        _sync(dev)
        copy_s = time.perf_counter() - t0
        out.update(copy_s=copy_s, copy_gbps=nbytes * iters / copy_s / 1e9)
    return out


OPS: dict[str, Callable[..., dict]] = {"sendrecv": _sendrecv, "broadcast": _broadcast, "all_gather": _all_gather,
                                       "bandwidth": _bandwidth}


def _worker(rank: int, world: int, op: str, uid_q, res_q, kwargs: dict) -> None:
    import torch

    backend = kwargs.pop("backend", "nccl")
    kind = _DEVICE_TYPE[backend]
    mod = device_module(kind)
    ndev = mod.device_count()
    if ndev == 0:
        raise RuntimeError(f"no {kind} device visible to this process")
    if ndev < world and backend == "nccl":
        from dockd.device import own_host_env

        os.environ.update(own_host_env(f"rank{rank}"))
    dev = torch.device(kind, rank % ndev)
    mod.set_device(dev)
    from dockd.device import Communicator

    comm = Communicator(backend, library_path=kwargs.pop("library_path", None))
    if rank == 0:
        uid = comm.unique_id()
        for _ in range(world - 1):
            uid_q.put(uid)
    else:
        uid = uid_q.get()
    comm.init(uid, rank, world, device=dev)
    try:
        result = OPS[op](comm, dev, **kwargs)
        _sync(dev)
    except BaseException:
        comm.abort()
        raise
    comm.destroy()
    version = comm.lib.version() if backend == "nccl" else 0  # (HCCL has no version call)
    res_q.put((rank, {**result, "device": dev.index, "nccl_version": version, "library": comm.lib.path}))


def run_ranks(op: str, world: int = 2, *, timeout: float = 120.0, **kwargs) -> list[dict]:
    """Run OPS[op] on `world` spawned ranks; the per-rank results, rank order. Raises on failure or
    timeout. `backend="hccl"` runs it on Ascend NPUs (default "nccl", CUDA GPUs)."""
    import torch.multiprocessing as mp

    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {sorted(OPS)}")
    ctx = mp.get_context("spawn")
    uid_q, res_q = ctx.Queue(), ctx.Queue()
    procs = mp.start_processes(_worker, args=(world, op, uid_q, res_q, kwargs), nprocs=world, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not procs.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{op} on {world} ranks did not finish in {timeout:.0f} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    results: dict[int, dict] = {}
    while len(results) < world:
        try:
            rank, res = res_q.get(timeout=10)
        except queue.Empty:
            raise RuntimeError(f"{op}: only ranks {sorted(results)} reported a result") from None
        results[rank] = res
    return [results[r] for r in range(world)]
