#!/usr/bin/env python3
"""One prepared GPU check of the NCCL bindings (dockd.device); finishes in about 5 minutes.

    python scripts/gpu_check.py [--budget 300] [--size-mib 256] [--iters 5]

1. prints the machine: torch, CUDA, GPUs, driver, the libnccl.so.2 that discovery picks and its version;
2. runs `pytest -m gpu tests/gpu tests/resharding -q` (send/recv, broadcast, all_gather between two
   processes; device gets; a cross-node device read over an NCCL device link, the reader on TCP;
   allgather-swap with collectives="device" on the bindings);
3. times a 256 MiB NCCL send/recv between two processes (two GPUs, or both on GPU 0) against a
   device-to-device copy of the same buffer in the same run, and prints both in GB/s;
4. times a get(device="cuda:0") of a 2 GiB sample held in a warehouse's device tier (CUDA IPC
   and one device-to-device copy) against the same copy, and the same get by a reader that
   reaches the warehouse over TCP, as one on another node does (an NCCL device link);
5. runs the GPU part of `python -m benchmarks.resharding` (allgather-swap on a bf16 layer stack of
   --resharding-params parameters: device memory freed during generation, swap bandwidth against
   pinned host<->device copies, the share of the swap-back hidden behind generation), with what is
   left of the budget; its JSON goes to --out-dir.

Exit status: 0 all passed; 1 a check failed; 2 no usable GPU / NCCL; 124 the time budget ran out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # subprocesses run from the checkout


def say(msg: str = "") -> None:
    print(msg, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole check (default 300)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tier-mib", type=int, default=2048,
                    help="sample size for the device-tier get figure (default 2048: a get's fixed round trips, "
                         "about a millisecond, must not dominate a copy that takes that long)")
    ap.add_argument("--skip-pytest", action="store_true", help="only the figures")
    ap.add_argument("--resharding-params", type=float, default=3e9,
                    help="parameters of the allgather-swap GPU benchmark's layer stack (default 3e9; 0: skip it)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench-results"),
                    help="where the resharding benchmark's JSON is written (default bench-results/)")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget
    left = lambda: deadline - time.monotonic()  # noqa: E731

    say("== dockd GPU check: NCCL bindings ==")
    import torch

    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        say("FAIL: needs an NVIDIA GPU with a CUDA build of torch")
        return 2
    n = torch.cuda.device_count()
    for i in range(n):
        say(f"  GPU {i}: {torch.cuda.get_device_name(i)}")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        say(f"  driver: {smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else smi.stderr.strip()}")
    from dockd.device import DockDeviceError, NcclLibrary

    try:
        lib = NcclLibrary()
        v = lib.version()
    except DockDeviceError as e:
        say(f"FAIL: {e}")
        return 2
    say(f"  libnccl: {lib.path} (NCCL {v // 10000}.{v // 100 % 100}.{v % 100}, code {v})")
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            from importlib.metadata import version

            say(f"  wheel {dist} {version(dist)}")
        except Exception:
            pass
    say(f"  ranks share GPU 0: {n < 2}" + (" (each on a host of its own: NCCL_HOSTID, socket transport on "
                                          "loopback, so the NCCL figures measure sockets, not the GPU)" if n < 2 else ""))

    failed = False
    if not args.skip_pytest:
        say("\n== pytest -m gpu tests/gpu tests/resharding -q ==")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "tests/resharding", "-q", "-rs", "-p", "no:cacheprovider"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=max(10.0, min(150.0, left() - 40)),
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired as e:
            say((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
            say("FAIL: pytest ran out of time")
            return 124
        say(proc.stdout.rstrip())
        if proc.stderr.strip():
            say(proc.stderr.rstrip()[-4000:])
        tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        bad_skips = unexpected_skips(proc.stdout, n)
        if proc.returncode != 0 or "passed" not in tail or bad_skips:
            say(f"FAIL: pytest exit {proc.returncode}, summary: {tail!r}"
                + (f"; CUDA tests skipped: {bad_skips}" if bad_skips else ""))
            failed = True
        else:
            say("pytest: OK")

    say(f"\n== {args.size_mib} MiB send/recv between 2 processes vs device-to-device copy ==")
    if left() < 20:
        say("FAIL: no time left for the bandwidth figures")
        return 124
    from dockd.device._selftest import run_ranks

    try:
        res = run_ranks("bandwidth", 2, timeout=max(10.0, left() - 5), size_mib=args.size_mib, iters=args.iters)
    except TimeoutError as e:
        say(f"FAIL: {e}")
        return 124
    except Exception as e:  # a failed rank: its traceback is in the exception text
        say(f"FAIL: bandwidth run: {type(e).__name__}: {e}")
        return 1
    r0, r1 = res
    say(f"  ranks on GPUs {r0['device']} -> {r1['device']}, {r0['iters']} x {r0['bytes'] >> 20} MiB, "
        f"NCCL {r0['nccl_version']}")
    say(f"  NCCL send/recv (sender clock):   {r0['nccl_gbps']:8.1f} GB/s  ({r0['nccl_s'] * 1e3:.1f} ms)")
    say(f"  NCCL send/recv (receiver clock): {r1['nccl_gbps']:8.1f} GB/s  ({r1['nccl_s'] * 1e3:.1f} ms)")
    say(f"  device-to-device copy (GPU {r0['device']}):  {r0['copy_gbps']:8.1f} GB/s  ({r0['copy_s'] * 1e3:.1f} ms; "
        "bytes copied, each read once and written once)")
    say(f"  NCCL / copy: {min(r0['nccl_gbps'], r1['nccl_gbps']) / r0['copy_gbps']:.2f}")
    say(f"\n== device tier: get(device='cuda:0') of {args.tier_mib} MiB held in a warehouse's device memory ==")
    if left() < 20:
        say("FAIL: no time left for the device-tier figure")
        return 124
    try:
        tier = device_tier_figure(args.tier_mib, args.iters)
    except Exception as e:  # noqa: BLE001 - report and fail, the other figures stand
        say(f"FAIL: device tier: {type(e).__name__}: {e}")
        failed = True
    else:
        say(f"  get (CUDA IPC, one device-to-device copy): {tier['get_gbps']:8.1f} GB/s  ({tier['get_s'] * 1e3:.1f} ms)")
        say(f"  device-to-device copy:                     {tier['copy_gbps']:8.1f} GB/s  ({tier['copy_s'] * 1e3:.1f} ms)")
        say(f"  get / copy: {tier['get_gbps'] / tier['copy_gbps']:.2f} (target >= 0.8)")
        say(f"  get over an NCCL device link (reader on TCP, {tier['far']}): {tier['link_gbps']:8.1f} GB/s  "
            f"({tier['link_s'] * 1e3:.1f} ms); link / copy: {tier['link_gbps'] / tier['copy_gbps']:.2f}")
    if args.resharding_params > 0:
        say(f"\n== allgather-swap on the GPU: python -m benchmarks.resharding --skip-cpu "
            f"--gpu-params {args.resharding_params:g} ==")
        if left() < 30:
            say("FAIL: no time left for the resharding figures")
            return 124
        out = os.path.join(args.out_dir, "resharding_gpu.json")
        cmd = [sys.executable, "-m", "benchmarks.resharding", "--skip-cpu", "--gpu-params",
               str(args.resharding_params), "--out", out]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=left() - 5, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            say("FAIL: the resharding benchmark ran out of time")
            return 124
        say(proc.stdout.rstrip())
        if proc.returncode != 0:
            say(proc.stderr.rstrip()[-4000:])
            say(f"FAIL: the resharding benchmark exited with {proc.returncode}")
            failed = True
    say("\nRESULT: " + ("FAIL" if failed else "OK"))
    return 1 if failed else 0


def unexpected_skips(output: str, gpus: int) -> list[str]:
    """The skip reasons in pytest's -rs summary that a CUDA machine should not show: the NPU cases
    skip here, and tests that need two GPUs on a machine with one; any other skip is a failure."""
    expected = ("needs an Ascend NPU", "torch_npu is installed but no NPU", "an HCCL link needs two NPUs")
    if gpus < 2:
        expected += ("needs two cuda devices",)
    return [line.strip() for line in output.splitlines()
            if line.startswith("SKIPPED") and not any(e in line for e in expected)]


def device_tier_figure(size_mib: int, iters: int) -> dict:
    """Best-of-`iters` seconds of a get(device="cuda:0") of one device-tier sample of `size_mib`
    MiB (acquire, CUDA IPC map, one copy), against a device-to-device copy of the same bytes."""
    import torch

    import dockd

    n = size_mib << 20
    src = torch.ones(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    copy_s = float("inf")
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copy_s = min(copy_s, time.perf_counter() - t0)
    get_s = link_s = float("inf")
    cap = f"{2 * size_mib + 64}MiB"
    ndev = torch.cuda.device_count()
    far = f"cuda:{min(1, ndev - 1)}"
    if ndev < 2:  # the link's two ends share the one GPU: the warehouse and this process claim hosts of their own
        from dockd.device import own_host_env

        os.environ.update(own_host_env("warehouse"))
    cluster = dockd.start_local(1, capacity=cap, extra_args=["--device-capacity", cap])  # the daemon copies the env
    if ndev < 2:
        os.environ["NCCL_HOSTID"] = own_host_env("reader")["NCCL_HOSTID"]
    with cluster as c, dockd.connect(c.address) as d:
        os.environ["DOCKD_TRANSPORT"] = "tcp"  # a reader as on another node: device link, no CUDA IPC
        try:
            remote = dockd.connect(c.address)
        finally:
            del os.environ["DOCKD_TRANSPORT"]
        with remote:
            d.put({"x": src[:1024].view(1, 1024)}, partition="warm", device="keep")
            remote.get("warm", ["x"], 1, partition="warm", device=far, timeout=120)  # opens the link
            for i in range(iters):
                for reader, dev, best in ((d, "cuda:0", "get"), (remote, far, "link")):
                    d.put({"x": src.view(1, n)}, partition="p", device="keep")
                    assert d.stats(traffic=True)["warehouses"][0]["device_bytes"] >= n, "not in the device tier"
                    t0 = time.perf_counter()
                    got = reader.get(f"c{i}", ["x"], 1, partition="p", device=dev, timeout=120)
                    torch.cuda.synchronize()
                    took = time.perf_counter() - t0
                    if best == "get":
                        get_s = min(get_s, took)
                    else:
                        link_s = min(link_s, took)
                    assert got["x"][0].device == torch.device(dev) and got["x"][0].numel() == n
                    d.clear("p")
    return {"get_s": get_s, "copy_s": copy_s, "get_gbps": n / get_s / 1e9, "copy_gbps": n / copy_s / 1e9,
            "link_s": link_s, "link_gbps": n / link_s / 1e9, "far": far}


if __name__ == "__main__":
    sys.exit(main())
