"""One rank of a multi-rank resharding check (run as a script by the tests).

usage: python _rank_worker.py SCENARIO_JSON RANK PORT OUT_DIR

Builds the full toy model on every rank, takes this rank's training shards,
runs enter/exit cycles and compares everything bit-exactly with the
single-process reference.  Writes OUT_DIR/rank{RANK}.json; mismatches are
reported in "errors", not raised, so the test can print them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from dockd.resharding import (
    AllGatherSwap,
    DeviceCollectives,
    ParallelLayout,
    ReshardConfig,
    build_groups,
    predict_memory,
)
from dockd.resharding.reference import (
    build_full_weights,
    generation_shard,
    toy_transformer_specs,
    training_shards,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def flatten_into_one_storage(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of one flat buffer per dtype, like a distributed-optimizer param buffer."""
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in shards.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    for dtype, names in by_dtype.items():
        flat = torch.empty(sum(shards[n].numel() for n in names), dtype=dtype, device=shards[names[0]].device)
        off = 0
        for n in names:
            t = shards[n]
            out[n] = flat.narrow(0, off, t.numel()).view(t.shape)
            out[n].copy_(t)
            off += t.numel()
    return out


class GlooComm:
    """The `dockd.device.Communicator` interface on a gloo group, so that
    DeviceCollectives' own logic (byte views, group positions, all-to-all as grouped
    send/recv) runs on CPU; on a GPU the scenario uses the real NCCL communicators."""

    initialized = True

    def __init__(self, group, ranks: list[int]) -> None:
        self.pg, self.ranks = group, ranks
        self.rank, self.world = ranks.index(dist.get_rank()), len(ranks)
        self._ops: list | None = None

    def all_gather(self, out, inp) -> None:
        dist.all_gather_into_tensor(out, inp, group=self.pg)

    def broadcast(self, t, root: int) -> None:
        dist.broadcast(t, src=self.ranks[root], group=self.pg)

    def _p2p(self, op, t, peer: int) -> None:
        assert self._ops is not None, "send/recv outside group(): NCCL would deadlock on a two-way exchange"
        self._ops.append(dist.P2POp(op, t, self.ranks[peer], self.pg))

    def send(self, t, peer: int) -> None:
        self._p2p(dist.isend, t, peer)

    def recv(self, t, peer: int) -> None:
        self._p2p(dist.irecv, t, peer)

    @contextlib.contextmanager
    def group(self):
        self._ops = []
        yield
        ops, self._ops = self._ops, None
        for req in dist.batch_isend_irecv(ops) if ops else ():
            req.wait()

    def destroy(self) -> None:
        pass


def collectives_for(sc: dict, train: ParallelLayout) -> dict:
    """AllGatherSwap's collectives argument(s) for the scenario."""
    kind = sc.get("collectives", "torch")
    if kind == "torch":
        return {}
    if kind == "device":  # the real NCCL/HCCL bindings (GPU machines)
        return {"collectives": "device"}
    groups = build_groups(train)
    comms = {dim: GlooComm(getattr(groups, dim), getattr(groups, f"{dim}_ranks"))
             for dim in ("tp", "pp", "ep") if len(getattr(groups, f"{dim}_ranks")) > 1}
    return {"groups": groups, "collectives": DeviceCollectives(groups, comms)}


def run(sc: dict, rank: int, errors: list[str]) -> dict:
    world = sc["world"]
    train = ParallelLayout(**sc["train"])
    gen = ParallelLayout(**sc["gen"])
    model = dict(sc["model"])
    model["dtype"] = DTYPES[model.get("dtype", "float32")]
    specs = toy_transformer_specs(pp=train.pp, **model)
    full = build_full_weights(specs, seed=sc.get("seed", 0))
    shards = training_shards(full, specs, train, world, rank)
    device = sc.get("device", "cpu")
    if device != "cpu":  # ranks share the machine's first GPU when there are fewer GPUs than ranks
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
        shards = {n: t.to(device) for n, t in shards.items()}
        full = {n: t.to(device) for n, t in full.items()}
    if sc.get("flat"):
        shards = flatten_into_one_storage(shards)
    else:  # what a trainer passes: parameters that require grad
        shards = {n: torch.nn.Parameter(t) for n, t in shards.items()}
    chunk = sc.get("gather_chunk_bytes", ReshardConfig().gather_chunk_bytes)
    config = ReshardConfig(mode=sc.get("mode", "swap"), gather_chunk_bytes=chunk)
    ags = AllGatherSwap(specs, shards, train=train, gen=gen, config=config, **collectives_for(sc, train))
    start_bytes = ags.device_bytes
    reports, host_ptrs, checked = [], [], 0
    for cycle in range(sc.get("cycles", 2)):
        before = {n: t.detach().clone() for n, t in shards.items()}
        weights = ags.enter_generation()
        reports.append(ags.last_report.as_dict())
        if sorted(weights) != sorted(s.name for s in specs):
            errors.append(f"cycle {cycle}: generation weights have the wrong names")
        for spec in specs:
            want = generation_shard(full[spec.name], spec, gen, rank)
            if not bits_equal(weights[spec.name], want):
                errors.append(f"cycle {cycle}: generation weight {spec.name} differs from the reference")
            checked += 1
        for name, t in shards.items():
            freed = t.untyped_storage().nbytes() == 0
            if freed != (ags.config.mode == "swap"):
                errors.append(f"cycle {cycle}: {name} storage freed={freed} in mode {ags.config.mode}")
        host_ptrs.append(ags.host_pool.data_ptr() if ags.host_pool is not None else 0)
        if cycle in sc.get("prefetch_cycles", []):
            ags.prefetch_update_weights()
            reports.append(ags.last_report.as_dict())
        probe = weights[specs[0].name]
        ags.exit_generation()
        reports.append(ags.last_report.as_dict())
        if probe.untyped_storage().nbytes() != 0:
            errors.append(f"cycle {cycle}: generation bucket still holds memory after exit")
        for name, t in shards.items():
            if not bits_equal(t, before[name]):
                errors.append(f"cycle {cycle}: update weight {name} not restored bit-exactly")
        if ags.device_bytes != start_bytes:
            errors.append(f"cycle {cycle}: device bytes {ags.device_bytes} != start {start_bytes}")
        # An optimizer step between cycles: the next enter must see new values.
        with torch.no_grad():
            for t in shards.values():
                t.add_(1)
            for name in full:
                full[name].add_(1)
    pool_bytes = ags.host_bytes
    ags.close()
    return {
        "rank": rank,
        "checked": checked,
        "start_bytes": start_bytes,
        "end_bytes": ags.device_bytes,
        "update_bytes": ags.update_bytes,
        "generation_bytes": ags.generation_bytes,
        "pool_bytes": pool_bytes,
        "host_ptrs": host_ptrs,
        "reports": reports,
        "model": predict_memory(specs, train, gen, world, rank, gather_chunk_bytes=chunk).as_dict(),
        "largest_param_bytes": max(s.nbytes for s in specs),
    }


def main() -> None:
    sc = json.loads(sys.argv[1])
    rank, port, out_dir = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    if sc.get("device", "cpu") != "cpu" and torch.cuda.device_count() < sc["world"]:
        from dockd.device import own_host_env

        os.environ.update(own_host_env(f"rank{rank}"))  # ranks share a GPU: NCCL needs them on "hosts" of their own
    store = dist.TCPStore("127.0.0.1", port, sc["world"], is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=sc["world"])
    errors: list[str] = []
    result: dict = {"rank": rank}
    try:
        result = run(sc, rank, errors)
    except Exception:
        errors.append(traceback.format_exc())
    result["errors"] = errors
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
