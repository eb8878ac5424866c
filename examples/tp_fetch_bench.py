"""Measure how a tensor-parallel group should read a batch from the dock.

    python examples/tp_fetch_bench.py [--repeats 20]

Two processes form one TP group (gloo on CPU). For each batch shape, rank 0 puts
the batch, then the group reads it three ways (`TPReader`):

  broadcast   the group's first rank fetches, then broadcasts header + payload
  shared      the first rank acquires and broadcasts the lease (metadata only),
              every rank fetches the data itself (same-host warehouse)
  group       every rank gets the batch itself with a model-parallel get
              (mp_group): no collective

and prints the median wall time of one group read (the slower rank counts),
next to a plain `dock.get` on one rank as the baseline.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dockd

SHAPES = [  # (samples, tokens per sample, dtype)
    (256, 16, torch.int64),
    (256, 1024, torch.int64),
    (64, 8192, torch.float32),
    (16, 262144, torch.bfloat16),
]


def _worker(rank: int, world: int, port: int, address: str, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    from dockd.trainer_plugins.megatron_grpo.comm import TPReader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    dock = dockd.connect(address)
    rows = []
    for n, length, dtype in SHAPES:
        mib = n * length * torch.empty(0, dtype=dtype).element_size() / 2**20
        for mode in ("one-rank", "broadcast", "shared", "group"):
            reader = TPReader(
                dock, mode="broadcast" if mode == "one-rank" else mode, tp_group=group, tp_src=0, tp_rank=rank
            )
            times = []
            for r in range(repeats + 2):
                part = f"bench/{mode}/{n}x{length}/{r}"
                if rank == 0:
                    dock.put({"x": torch.ones(n, length, dtype=dtype)}, partition=part)
                dist.barrier()
                t0 = time.perf_counter()
                if mode == "one-rank":  # baseline: a plain get on one rank, no collective
                    if rank == 0:
                        got = dock.get(consumer="c", columns=["x"], count=n, partition=part, timeout=30)
                        assert len(got.indexes) == n
                else:
                    batch = reader.get(consumer="c", columns=["x"], count=n, partition=part, timeout=30)
                    assert len(batch.indexes) == n
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if r >= 2:
                    times.append(float(dt))
                dist.barrier()
                if rank == 0:
                    dock.clear(part)
            rows.append((f"{n}x{length} {str(dtype).removeprefix('torch.')}", mib, mode, statistics.median(times)))
    if rank == 0:
        out.put(rows)
    dock.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with dockd.start_local(num_warehouses=1) as cluster:
        mp.start_processes(
            _worker, args=(2, port, cluster.address, a.repeats, out), nprocs=2, join=True, start_method="spawn"
        )
    rows = out.get()
    print(f"{'batch':<24}{'MiB':>8}  {'mode':<10}{'median ms':>10}")
    for name, mib, mode, sec in rows:
        print(f"{name:<24}{mib:8.2f}  {mode:<10}{sec * 1e3:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
