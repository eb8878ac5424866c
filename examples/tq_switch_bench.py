"""Which TransferQueue switch to build: a TQ storage backend, or a transfer_queue-compatible client?

    pip install transferqueue==0.1.10 pyzmq msgspec prometheus_client psutil
    python examples/tq_switch_bench.py [--repeats 30]

A storage backend (TQ's ``StorageManagerFactory`` / ``StorageClientFactory``)
keeps TQ's controller in the path of every call and swaps only where the bytes
live; a compatible client replaces both. So the measurement that decides is:

  tq metadata-only   kv_batch_put of tags only: TQ's controller round trips, no
                     payload -- the floor every op pays with a dockd *backend*
  tq put+get         kv_batch_put + kv_batch_get of real fields (SimpleStorage)
  dockd put+get      dock.put + dock.get of the same fields: what the
                     *compatible client* pays per call

Prints the median milliseconds of each for a small and a larger batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

import dockd

SHAPES = [(64, 128), (64, 16384)]  # (keys, int64 tokens per key)


def _median_ms(fn: Any, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_tq(repeats: int) -> dict[str, float]:
    import ray
    import transfer_queue as tq
    from tensordict import TensorDict

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # TQ's controller and each storage unit are Ray actors that reserve a CPU each
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out: dict[str, float] = {}
    try:
        from omegaconf import OmegaConf

        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}}))
        counter = [0]
        for n, length in SHAPES:

            def tags_only(n: int = n) -> None:
                counter[0] += 1
                keys = [f"m{counter[0]}-{i}" for i in range(n)]
                tq.kv_batch_put(keys=keys, partition_id="meta", tags=[{"s": 1}] * n)
                tq.kv_clear(keys=keys, partition_id="meta")

            def put_get(n: int = n, length: int = length) -> None:
                counter[0] += 1
                keys = [f"d{counter[0]}-{i}" for i in range(n)]
                fields = TensorDict({"input_ids": torch.ones(n, length, dtype=torch.int64)}, batch_size=n)
                tq.kv_batch_put(keys=keys, partition_id="data", fields=fields)
                got = tq.kv_batch_get(keys=keys, partition_id="data", select_fields=["input_ids"])
                assert got["input_ids"].shape[0] == n  # TQ hands back a jagged nested tensor
                tq.kv_clear(keys=keys, partition_id="data")

            out[f"tq metadata-only {n}x{length}"] = _median_ms(tags_only, repeats)
            out[f"tq put+get {n}x{length}"] = _median_ms(put_get, repeats)
        tq.close()
    finally:
        ray.shutdown()
    return out


def bench_dockd(repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with dockd.start_local(num_warehouses=2) as cluster, dockd.connect(cluster.address) as dock:
        counter = [0]
        for n, length in SHAPES:

            def put_get(n: int = n, length: int = length) -> None:
                counter[0] += 1
                part = f"b{counter[0]}"
                dock.put({"input_ids": torch.ones(n, length, dtype=torch.int64)}, partition=part)
                got = dock.get("c", ["input_ids"], n, partition=part, timeout=10)
                assert len(got.indexes) == n
                dock.clear(part)

            out[f"dockd put+get {n}x{length}"] = _median_ms(put_get, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = bench_dockd(a.repeats)
    try:
        results.update(bench_tq(a.repeats))
    except ImportError as exc:
        print(f"transferqueue not installed ({exc}); measured dockd only", file=sys.stderr)
    for name in sorted(results, key=lambda k: (k.split()[-1], k)):
        print(f"{name:<36}{results[name]:9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
