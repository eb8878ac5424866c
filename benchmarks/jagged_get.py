"""The jagged get of GRPO-shaped batches against memcpy of the same bytes (issue 45).

The workload of ``benchmarks.columnar --only=grpo``'s jagged get: 2,048 GRPO-shaped samples
(`columnar.grpo_samples`: six ragged 1-D tensor columns of 128..2048 elements, a float reward and a
string uid, ~31 KiB each), put 64 at a time with the six ragged columns as jagged nested tensors,
then got 64 at a time on the same host (`start_local(1)`, one client, one torch thread), every
ragged column taken as one jagged nested tensor (`batch.jagged(col)`) and every byte of its values
read by the consumer, the two msgpack columns as lists. ``--batch B`` gets B at a time instead: a get
of more than one put's samples has its ragged columns' runs joined into one buffer (a copy). Cases:

- ``get``: one get per batch (its acquire: the values come inline from the controller's own
  warehouse, one round trip), then the read.
- ``prefetch``: get(prefetch=P): one acquire per P gets.
- ``overlap``: get(prefetch=P) on a thread of its own one batch ahead of the consumer (`Ahead`
  below): the next get's round trips in flight while this batch is read.
- ``packed``: as ``prefetch``, each ragged column taken as the `dockd.Jagged` (values, offsets) pair
  (`batch.packed(col)`) instead of a nested tensor.
- ``call``: the get alone (no jagged tensors built, nothing read): the round trips' share.

Each repeat runs every case once on a fresh partition (the puts untimed), the cases in turn, so the
cases of one repeat share the machine's load; figures are medians over the repeats. The ceiling is
a single-thread memcpy of one batch's bytes into warm memory, cycling through 256 MiB (the same
run; `columnar.memcpy_gbps`). The consumer reads each buffer as the widest integer words its size divides
into (`read_words`, columnar's `read_all`); ``--bytewise`` reads as `read_all` did before 2026-12-05, byte by
byte where a buffer's size is not a multiple of 8 (the figures taken that way). ``--profile CASE`` runs one more pass of CASE under cProfile in the
client and prints its top functions (by ``--sort``, default tottime).

    python -m benchmarks.jagged_get [--repeats 3] [--samples 2048] [--batch 64] [--prefetch 4] [--bytewise] [--profile get [--sort cumtime]]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks import columnar
from benchmarks.columnar import GRPO_BATCH, TENSORS, as_jagged, grpo_samples, memcpy_gbps, sample_bytes

CASES = ("get", "prefetch", "overlap", "packed", "call")
read_words = columnar.read_all


def read_bytewise(t: torch.Tensor) -> int:
    """How columnar's `read_all` read before it read by words: int64 words where the size is a multiple of
    8, else byte by byte (``--bytewise``, to compare with figures taken that way)."""
    flat = t.reshape(-1).view(torch.uint8)
    return int((flat.view(torch.int64) if flat.numel() % 8 == 0 else flat).sum())


READ: list[Callable[[torch.Tensor], int]] = [read_words]  # (--bytewise: read_bytewise)


def consume(b, packed: bool = False) -> int:
    """What the consumer does with a batch: every ragged column's values read in full (taken as a jagged
    nested tensor, or with `packed` as the Jagged pair), the rest listed."""
    n = 0
    read = READ[0]
    for k in b.columns:
        if k not in TENSORS:
            n += len(b[k])
        elif packed:
            n += read(b.packed(k).values)
        else:
            n += read(b.jagged(k).values())
    return n


class Ahead:
    """Batches got on a thread of their own, one ahead of the consumer: the next get's round trips
    run while the consumer reads this batch (a get waits on its sockets without the GIL)."""

    def __init__(self, get: Callable[[], Any], n: int) -> None:
        self._get, self._n = get, n
        self._slot: list[Any] = []
        self._ready = threading.Semaphore(0)
        self._free = threading.Semaphore(1)

    def _run(self) -> None:
        for _ in range(self._n):
            self._free.acquire()
            try:
                self._slot.append(self._get())
            except BaseException as e:  # handed to the consumer
                self._slot.append(e)
            self._ready.release()

    def __iter__(self) -> Iterator[Any]:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        for _ in range(self._n):
            self._ready.acquire()
            b = self._slot.pop()
            self._free.release()
            if isinstance(b, BaseException):
                raise b
            yield b
        t.join()


def _pass(d, case: str, part: str, names: list[str], gets: int, prefetch: int, batch: int = GRPO_BATCH) -> int:
    """One pass of `case` over a partition of `gets` batches of `batch` samples; returns the samples got."""
    def get(p: int = 0):
        return d.get("trainer", names, batch, partition=part, timeout=60, prefetch=p)

    got = 0
    if case == "overlap":
        for b in Ahead(lambda: get(prefetch), gets):
            consume(b)
            got += len(b)
        return got
    for _ in range(gets):
        b = get(prefetch if case in ("prefetch", "packed") else 0)
        if case != "call":
            consume(b, packed=case == "packed")
        got += len(b)
    return got


def measure(*, samples: int = 2048, repeats: int = 3, prefetch: int = 4, cases=CASES, batch: int = GRPO_BATCH,
            profile: str | None = None, sort: str = "tottime") -> dict[str, Any]:
    """Each case's time per get of `batch` samples (the puts are of GRPO_BATCH) against memcpy of as many bytes."""
    import dockd

    if batch < 1 or samples % batch or samples % GRPO_BATCH:
        raise ValueError(f"--samples ({samples}) must be a multiple of --batch ({batch}) and of {GRPO_BATCH}")
    torch.set_num_threads(1)
    data = grpo_samples(samples)
    names = list(data)
    chunks = [as_jagged({k: v[s:s + GRPO_BATCH] for k, v in data.items()}) for s in range(0, samples, GRPO_BATCH)]
    gets = samples // batch
    nbytes = sample_bytes(data)
    times: dict[str, list[float]] = {c: [] for c in cases}
    loads = []
    res: dict[str, Any] = {}
    with dockd.start_local(1, capacity="8GiB") as cluster, dockd.connect(cluster.address) as d:
        warm = chunks[:4]  # segments, staging, the first mappings
        for c in warm:
            d.put(c, partition="warm")
        _pass(d, "get", "warm", names, len(warm), 0)  # (of GRPO_BATCH: the warm partition holds 4 puts)
        d.clear("warm")
        for r in range(repeats):
            for case in cases:
                part = f"jget-{case}-{r}"
                for c in chunks:
                    d.put(c, partition=part)
                t0 = time.perf_counter()
                got = _pass(d, case, part, names, gets, prefetch, batch)
                times[case].append(time.perf_counter() - t0)
                assert got == samples, (case, got)
                d.clear(part)
            loads.append(os.getloadavg()[0])
        if profile:
            part = "jget-profile"
            for c in chunks:
                d.put(c, partition=part)
            prof = cProfile.Profile()
            prof.enable()
            _pass(d, profile, part, names, gets, prefetch, batch)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(30)
            res["profile"] = out.getvalue()
    memcpy = memcpy_gbps(nbytes * batch // samples)
    res.update({"bytes_per_sample": nbytes / samples, "memcpy_batch_GBps": memcpy, "loadavg": loads,
                "prefetch": prefetch, "batch": batch})
    for case, ts in times.items():
        t = statistics.median(ts)
        res[f"{case}_ms_per_get"] = t / gets * 1e3
        res[f"{case}_samples_per_s"] = samples / t
        res[f"{case}_vs_memcpy"] = nbytes / t / 1e9 / memcpy
    res["memcpy_ms_per_batch"] = nbytes / gets / memcpy / 1e6
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--batch", type=int, default=GRPO_BATCH, help=f"samples per get (the puts are of {GRPO_BATCH})")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--profile", choices=CASES, default=None)
    ap.add_argument("--sort", default="tottime", help="--profile's order (a pstats key: tottime, cumtime)")
    ap.add_argument("--bytewise", action="store_true",
                    help="read as benchmarks.columnar does (byte by byte where a buffer's size is not a multiple of 8)")
    a = ap.parse_args()
    if a.bytewise:
        READ[0] = read_bytewise
    res = measure(samples=a.samples, repeats=a.repeats, prefetch=a.prefetch, cases=a.cases.split(","),
                  batch=a.batch, profile=a.profile, sort=a.sort)
    prof = res.pop("profile", None)
    print(json.dumps(res, indent=1))
    if prof:
        print(prof)


if __name__ == "__main__":
    main()
    os._exit(0)
