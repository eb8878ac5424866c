"""allgather-swap benchmark: the memory model against measurement, and swap speed.

    python -m benchmarks.resharding --out bench-results/resharding.json
    python benchmarks/resharding.py --out ... [--skip-gpu] [--gpu-params 3e9]

CPU part (always): multi-rank gloo worlds on loopback reshard a toy decoder
stack of a few hundred MB, once in the naive "resident" mode and once with
allgather-swap, and compare each rank's measured byte accounting with the
memory model of ``dockd.resharding.memory``.

GPU part (when CUDA is available): one process, one GPU, a bf16 layer stack
of ``--gpu-params`` parameters.  Measures ``torch.cuda.max_memory_allocated``
around generation for naive vs allgather-swap, the freed bytes, the swap
bandwidth against the pinned host<->device copy limit measured in the same
run, and whether ``prefetch_update_weights`` hides the swap-back behind a
simulated generation tail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dockd.resharding import AllGatherSwap, ParallelLayout, ReshardConfig, predict_memory, training_local_shape
from dockd.resharding.reference import toy_transformer_specs

MB = 1 << 20
GB = 1e9

# Each CPU scenario: world size, layouts, toy model.  About 340 MB of fp32
# weights (dense) and 300 MB (MoE).
DENSE = {"hidden": 1024, "ffn": 2816, "layers": 4, "vocab": 16384, "kv_hidden": 256}
MOE = {"hidden": 1024, "ffn": 2816, "layers": 2, "vocab": 16384, "kv_hidden": 256, "experts": 8, "moe_ffn": 1024}
TINY = {"hidden": 64, "ffn": 128, "vocab": 256, "kv_hidden": 16, "moe_ffn": 32}
CPU_SCENARIOS: list[dict[str, Any]] = [
    {"name": "tp2->tp1", "world": 2, "train": {"tp": 2}, "gen": {"tp": 1}, "model": DENSE},
    {"name": "tp1(dp2)->tp2", "world": 2, "train": {"tp": 1}, "gen": {"tp": 2}, "model": DENSE},
    {"name": "tp2.pp2->tp2", "world": 4, "train": {"tp": 2, "pp": 2}, "gen": {"tp": 2}, "model": DENSE},
    {"name": "tp1.ep2 moe->tp2", "world": 2, "train": {"tp": 1, "ep": 2}, "gen": {"tp": 2}, "model": MOE},
    # generation TP wider than a training stage: per-parameter broadcast path
    {"name": "tp1.pp2->tp2", "world": 2, "train": {"tp": 1, "pp": 2}, "gen": {"tp": 2}, "model": DENSE},
]


# --------------------------------------------------------------------- CPU
def _shards(specs: list, train: ParallelLayout, world: int, rank: int) -> dict[str, torch.Tensor]:
    stage = train.coords(rank, world).pp_rank
    g = torch.Generator().manual_seed(rank)
    return {
        s.name: torch.randn(training_local_shape(s, train), generator=g).to(s.dtype)
        for s in specs
        if s.stage == stage
    }


def cpu_worker(sc: dict[str, Any], rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    world = sc["world"]
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    train, gen = ParallelLayout(**sc["train"]), ParallelLayout(**sc["gen"])
    specs = toy_transformer_specs(pp=train.pp, **sc["model"])
    shards = _shards(specs, train, world, rank)
    result: dict[str, Any] = {"rank": rank, "model": predict_memory(specs, train, gen, world, rank).as_dict()}
    for mode in ("resident", "swap"):
        with AllGatherSwap(specs, shards, train=train, gen=gen, config=ReshardConfig(mode=mode)) as ags:
            start = ags.device_bytes
            for _ in range(2):  # the second cycle runs with a warm host pool
                ags.enter_generation()
                enter = ags.last_report
                ags.exit_generation()
            result[mode] = {
                "start_bytes": start,
                "generation_device_bytes": enter.device_bytes_after,
                "enter": enter.as_dict(),
                "exit": ags.last_report.as_dict(),
                "end_bytes": ags.device_bytes,
                "generation_bytes": ags.generation_bytes,
                "update_bytes": ags.update_bytes,
            }
    # host memcpy limit in the same process, for the swap bandwidth
    a = torch.empty(128 * MB, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(4):
        b.copy_(a)
    result["memcpy_gbps"] = 4 * a.numel() / (time.perf_counter() - t0) / GB
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_cpu_scenario(sc: dict[str, Any]) -> list[dict[str, Any]]:
    world = sc["world"]
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(sc),
                              str(r), str(store.port), tmp], env=env)
            for r in range(world)
        ]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"scenario {sc['name']}: ranks exited with {codes}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def cpu_rows(sc: dict[str, Any], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in ranks:
        m, sw, rs = r["model"], r["swap"], r["resident"]
        enter = sw["enter"]
        secs = enter["phase_seconds"]
        rows.append({
            "scenario": sc["name"], "rank": r["rank"],
            "update_MB": sw["update_bytes"] / MB,
            "model_update_MB": m["update_bytes"] / MB,
            "gen_MB": sw["generation_bytes"] / MB,
            "model_gen_MB": m["generation_bytes"] / MB,
            "naive_during_gen_MB": rs["generation_device_bytes"] / MB,
            "model_naive_MB": m["naive_generation_bytes"] / MB,
            "swap_during_gen_MB": sw["generation_device_bytes"] / MB,
            "model_swap_MB": m["swap_generation_bytes"] / MB,
            "freed_MB": (rs["generation_device_bytes"] - sw["generation_device_bytes"]) / MB,
            "enter_peak_MB": enter["peak_device_bytes"] / MB,
            "model_enter_peak_MB": m["enter_peak_bytes"] / MB,
            "gathered_MB": enter["gathered_bytes"] / MB,
            "alltoall_MB": enter["alltoall_bytes"] / MB,
            "broadcast_MB": enter["broadcast_bytes"] / MB,
            "enter_s": sum(secs.values()),
            "exit_s": sum(sw["exit"]["phase_seconds"].values()),
            "swap_out_gbps": sw["update_bytes"] / max(secs["swap_out"], 1e-9) / GB,
            "swap_in_gbps": sw["update_bytes"] / max(sw["exit"]["phase_seconds"]["swap_in"], 1e-9) / GB,
            "memcpy_gbps": r["memcpy_gbps"],
            "model_max_rel_err": max(
                abs(a - b) / b for a, b in [
                    (sw["update_bytes"], m["update_bytes"]), (sw["generation_bytes"], m["generation_bytes"]),
                    (rs["generation_device_bytes"], m["naive_generation_bytes"]),
                    (sw["generation_device_bytes"], m["swap_generation_bytes"]),
                    (enter["peak_device_bytes"], m["enter_peak_bytes"]),
                ]
            ),
            "leak_bytes": sw["end_bytes"] - sw["start_bytes"] + rs["end_bytes"] - rs["start_bytes"],
            "phase_seconds": secs,
        })
    return rows


def run_cpu(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for sc in scenarios:
        rows += cpu_rows(sc, run_cpu_scenario(sc))
    cols = [("scenario", "scenario", 17, "s"), ("rank", "rank", 4, "d"), ("update_MB", "update", 8, ".1f"),
            ("gen_MB", "gen", 8, ".1f"), ("naive_during_gen_MB", "naive@gen", 9, ".1f"),
            ("swap_during_gen_MB", "swap@gen", 9, ".1f"), ("model_swap_MB", "model", 8, ".1f"),
            ("model_max_rel_err", "model_err", 9, ".1e"),
            ("freed_MB", "freed", 8, ".1f"), ("enter_peak_MB", "peak", 8, ".1f"), ("enter_s", "enter_s", 7, ".3f"),
            ("exit_s", "exit_s", 7, ".3f"), ("swap_out_gbps", "out", 6, ".2f"), ("swap_in_gbps", "in", 6, ".2f"),
            ("memcpy_gbps", "memcpy", 6, ".2f")]
    print("\nCPU (gloo): MB per rank; model = predicted swap@gen, model_err = max relative gap of the five "
          "measured byte counts to the model;\nout/in = swap GB/s, memcpy = host copy GB/s in the same process")
    print(" ".join(h.ljust(w) if f == "s" else h.rjust(w) for _, h, w, f in cols))
    for row in rows:
        print(" ".join(format(row[c], (("<" if f == "s" else ">") + str(w) + f)) for c, _, w, f in cols))
    return rows


# --------------------------------------------------------------------- GPU
def _pinned_limit(nbytes: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name + "_gbps"] = 5 * nbytes / (time.perf_counter() - t0) / GB
    del host, dev
    torch.cuda.empty_cache()
    return out


def _generation(weight: torch.Tensor, steps: int) -> None:
    """Stand-in for decoding: matmuls against one generation weight."""
    x = torch.randn(64, weight.shape[-1], device=weight.device, dtype=weight.dtype)
    for _ in range(steps):
        x = torch.nn.functional.linear(x, weight)[:, : weight.shape[-1]].contiguous()
        x = x / (x.norm() + 1)


def run_gpu(params: float) -> dict[str, Any]:
    torch.cuda.set_device(0)
    total = torch.cuda.get_device_properties(0).total_memory
    params = min(params, total / 2 / 2 / 1.3)  # update + generation copies in bf16, with headroom
    hidden, ffn = 4096, 11008
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    layers = max(1, int(params // per_layer))
    specs = [s for s in toy_transformer_specs(hidden=hidden, ffn=ffn, layers=layers, vocab=32000,
                                              dtype=torch.bfloat16) if s.name.startswith("layers.")]
    n_params = sum(s.numel for s in specs)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    limit = _pinned_limit(1 << 30)
    layout = ParallelLayout(tp=1)
    shards = {s.name: torch.randn(s.shape, device="cuda", dtype=torch.bfloat16) for s in specs}
    probe = next(s.name for s in specs if s.name.endswith("mlp.gate_up.weight"))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "params": n_params,
                              "layers": layers, "hidden": hidden, "ffn": ffn, "limit": limit}

    def gen_steps_for(seconds: float, weight: torch.Tensor) -> int:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _generation(weight, 20)
        torch.cuda.synchronize()
        return max(20, int(20 * seconds / (time.perf_counter() - t0)))

    for mode in ("resident", "swap"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with AllGatherSwap(specs, shards, train=layout, gen=layout, config=ReshardConfig(mode=mode)) as ags:
            weights = ags.enter_generation()
            enter = ags.last_report
            enter_max = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            during = torch.cuda.memory_allocated()
            _generation(weights[probe], 50)
            torch.cuda.synchronize()
            result[mode] = {"allocated_before": before, "allocated_during_generation": during,
                            "max_allocated_generation": torch.cuda.max_memory_allocated(),
                            "max_allocated_enter": enter_max, "enter": enter.as_dict()}
            ags.exit_generation()
            result[mode]["exit"] = ags.last_report.as_dict()
            if mode == "swap":
                upd = ags.update_bytes
                out_s = enter.phase_seconds["swap_out"]
                in_s = ags.last_report.phase_seconds["swap_in"]
                result["swap_bandwidth"] = {
                    "out_gbps": upd / out_s / GB, "in_gbps": upd / in_s / GB,
                    "out_vs_limit": upd / out_s / GB / limit["d2h_gbps"],
                    "in_vs_limit": upd / in_s / GB / limit["h2d_gbps"],
                }
                # prefetch: generation tail twice as long as the swap-in
                steps = gen_steps_for(2 * in_s, shards[probe])
                timings = {}
                for prefetch in (False, True):
                    weights = ags.enter_generation()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if prefetch:
                        ags.prefetch_update_weights()
                    _generation(weights[probe], steps)
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    ags.exit_generation()
                    t2 = time.perf_counter()
                    timings["prefetch" if prefetch else "plain"] = {"generation_s": t1 - t0, "exit_s": t2 - t1}
                plain, pre = timings["plain"], timings["prefetch"]
                hidden_s = plain["generation_s"] + plain["exit_s"] - pre["generation_s"] - pre["exit_s"]
                result["prefetch"] = {**timings, "swap_in_s": in_s,
                                      "hidden_fraction": max(0.0, min(1.0, hidden_s / in_s))}
    result["freed_bytes"] = (result["resident"]["allocated_during_generation"]
                             - result["swap"]["allocated_during_generation"])
    dist.destroy_process_group()
    r, s = result["resident"], result["swap"]
    print(f"\nGPU {result['device']}: {n_params / 1e9:.2f}B params bf16 ({layers} layers), world 1")
    print(f"  allocated during generation: naive {r['allocated_during_generation'] / GB:.2f} GB, "
          f"allgather-swap {s['allocated_during_generation'] / GB:.2f} GB, freed {result['freed_bytes'] / GB:.2f} GB")
    print(f"  max_memory_allocated during generation: naive {r['max_allocated_generation'] / GB:.2f} GB, "
          f"swap {s['max_allocated_generation'] / GB:.2f} GB; inside enter_generation: naive "
          f"{r['max_allocated_enter'] / GB:.2f} GB, swap {s['max_allocated_enter'] / GB:.2f} GB")
    bw = result["swap_bandwidth"]
    print(f"  swap out {bw['out_gbps']:.1f} GB/s ({bw['out_vs_limit']:.2f}x of pinned d2h "
          f"{limit['d2h_gbps']:.1f}), in {bw['in_gbps']:.1f} GB/s ({bw['in_vs_limit']:.2f}x of pinned h2d "
          f"{limit['h2d_gbps']:.1f}); target >= 0.8x")
    p = result["prefetch"]
    print(f"  exit without prefetch {p['plain']['exit_s'] * 1e3:.1f} ms, with prefetch "
          f"{p['prefetch']['exit_s'] * 1e3:.1f} ms; hidden fraction of the swap-in {p['hidden_fraction']:.2f}")
    return result


# -------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--skip-cpu", action="store_true", help="skip the multi-rank gloo part")
    ap.add_argument("--skip-gpu", action="store_true", help="skip the CUDA part even if a GPU is present")
    ap.add_argument("--gpu-params", type=float, default=3e9, help="parameters of the GPU layer stack (bf16)")
    ap.add_argument("--scenarios", nargs="*", help="CPU scenario names to run (default: all)")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU models (a smoke run of a few seconds)")
    ap.add_argument("--worker", nargs=4, metavar=("SCENARIO", "RANK", "PORT", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        sc, rank, port, out = args.worker
        cpu_worker(json.loads(sc), int(rank), int(port), Path(out))
        return 0
    result: dict[str, Any] = {
        "benchmark": "resharding",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }
    if not args.skip_cpu:
        scenarios = [s for s in CPU_SCENARIOS if not args.scenarios or s["name"] in args.scenarios]
        if args.tiny:
            scenarios = [{**s, "model": {**s["model"], **TINY}} for s in scenarios]
        result["cpu"] = {"scenarios": scenarios, "rows": run_cpu(scenarios)}
    if args.skip_gpu or not torch.cuda.is_available():
        result["gpu"] = None
        print("\nGPU part skipped: " + ("--skip-gpu" if args.skip_gpu else "no CUDA device on this machine"))
    else:
        result["gpu"] = run_gpu(args.gpu_params)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
