"""What one poll of an unchanged partition costs: verl's V1 ReplayBuffer calls transfer_queue's
``kv_list()`` every poll_interval and walks every key; ``dock.list`` users poll a partition's samples.

``python -m benchmarks.kv_list_poll [--keys 10000,100000] [--polls 50]`` starts a local dock (a
controller and one warehouse), fills a TQ partition with tag-only keys (verl's prompt keys,
``{"is_prompt": True, "status": ..., "global_steps": ...}``) and a dock partition with as many
samples, then times, per poll (median of ``--polls``):

- ``kv_list(pid)`` and ``kv_list()`` on dockd's transfer_queue switch (dockd's part of a poll),
- verl's own loop over the answer (ReplayBuffer._sync_metadata_from_transfer_queue's, run on the
  answer alone), beside it,
- ``dock.list(p, limit=n)`` (the whole listing) and, where the dock has it,
  ``dock.list(p, since=cursor)`` of the unchanged partition.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _median_us(fn: Callable[[], Any], polls: int) -> float:
    fn()
    times = []
    for _ in range(polls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def verl_loop(data: dict[str, dict[str, dict]]) -> None:
    """The body of verl 0.9's ReplayBuffer._sync_metadata_from_transfer_queue over kv_list()'s answer."""
    partitions: dict[str, dict[str, dict]] = defaultdict(dict)
    status_keys: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    steps: dict[str, dict[str, int]] = defaultdict(dict)
    for partition_id, items in data.items():
        partition = partitions[partition_id]
        for key, tag in items.items():
            if tag.get("is_prompt", False):
                steps[partition_id][key] = tag["global_steps"]
                status_keys[tag["status"]][partition_id].add(key)
            else:
                if key not in partition:
                    partition[key] = {}
                partition[key].update(tag)


def one_size(address: str, n: int, polls: int) -> dict[str, float]:
    import dockd
    from dockd.trainer_plugins.verl import transfer_queue as tq

    pid = f"poll{n}"
    statuses = ("pending", "running", "finished")
    for lo in range(0, n, 5000):
        keys = [f"{pid}k{i}" for i in range(lo, min(n, lo + 5000))]
        tq.kv_batch_put(keys=keys, partition_id=pid,
                        tags=[{"is_prompt": True, "status": statuses[i % 3], "global_steps": i % 7}
                              for i in range(len(keys))])
    out: dict[str, float] = {"keys": n}
    assert len(tq.kv_list(pid)[pid]) == n
    out["kv_list(pid) us"] = _median_us(lambda: tq.kv_list(pid), polls)
    out["kv_list() us"] = _median_us(tq.kv_list, polls)
    answer = tq.kv_list()
    out["verl loop us"] = _median_us(lambda: verl_loop(answer), max(5, polls // 5))
    with dockd.connect(address) as dock:
        part = f"plain{n}"
        for lo in range(0, n, 10000):
            k = min(n, lo + 10000) - lo
            dock.put({"x": torch.zeros(k, 1, dtype=torch.int32)}, partition=part,
                     tags={"age": np.arange(k) % 3})
        out["dock.list full us"] = _median_us(lambda: dock.list(part, limit=n), max(5, polls // 5))
        try:
            first = dock.list(part, since="", limit=n)  # type: ignore[call-arg]
        except TypeError:
            return out  # a dock without change cursors
        cursor = first["cursor"]
        assert len(first["indexes"]) == n and not first["more"], first.keys()

        def poll() -> None:
            r = dock.list(part, since=cursor)  # type: ignore[call-arg]
            assert not r["indexes"] and not r["deleted"] and not r["full"]

        out["dock.list since us"] = _median_us(poll, polls)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_list_poll")
    p.add_argument("--keys", default="10000,100000")
    p.add_argument("--polls", type=int, default=50)
    args = p.parse_args(argv)
    import dockd
    from dockd.trainer_plugins.verl import transfer_queue as tq

    with dockd.start_local(num_warehouses=1, capacity="2GiB") as cluster:
        tq.init(address=cluster.address)
        try:
            rows = [one_size(cluster.address, int(k), args.polls) for k in args.keys.split(",")]
        finally:
            tq.close()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    names = list(dict.fromkeys(k for r in rows for k in r))
    print(f"medians of {args.polls} polls; loadavg at end {load}")
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.0f}" if k in r else "-" for k in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
