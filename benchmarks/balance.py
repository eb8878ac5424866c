"""Token balance across data-parallel ranks: ``dockd.balance.balance`` against a greedy heap.

    python -m benchmarks.balance [--json PATH] [--dp 2,4,8,16,32] [--counts 8,64,256]
                                 [--groups 1,8] [--batches 5] [--repeats 5]

One global batch of ``dp * count`` samples is split among ``dp`` ranks, every
rank getting exactly ``count`` samples, once by `dockd.balance.balance` and
once by the greedy heap partition that MindSpeed-RL's sequence-length
balancing uses (``heapq_partition(..., equal_size=True)``): sort the lengths
descending and give each to the rank with the smallest token sum (ties: fewer
samples, then lower rank) that still has room. With groups (``group_size``
8, GRPO: the responses to one prompt) both methods split whole groups; the
greedy heap then runs on the group sums. The "by position" column is the
split without balancing (rank r takes the r-th consecutive slice: a
rank-aware get without ``balance_by``).

Workloads (sample weight = prompt + response tokens):

- ``longtail``: prompt uniform in 64..1024 (one prompt per group, shared by
  its members), response lognormal (mu 6.5, sigma 1.0, ~665 tokens median)
  rounded and clipped to 16..8192: a few very long rollouts, many short ones.
- ``uniform``: uniform in 64..8192.

Per case (workload, group size, dp, count) ``batches`` random batches (seeds
0..batches-1) are split by both methods. Reported: the max/min ratio of the
rank token sums and their spread (max - min, tokens), each the median over
the batches, and the worst spread over the batches; the time per call, the
median over ``repeats`` calls on each batch (the greedy heap gets a Python
list, as MindSpeed-RL passes it; balance gets the numpy array). Timing is
single-threaded CPU wall time (``time.perf_counter``). The script asserts
nothing about time or quality; it prints a Markdown table and ``--json`` writes
every per-batch figure, the config, the machine and the versions.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import machine, versions
from dockd.balance import balance

NAME = "balance"
TITLE = "Token balance across DP ranks: dockd.balance (Karmarkar-Karp + refinement) vs greedy heap"

WORKLOADS = ("longtail", "uniform")
METHODS = ("dockd", "greedy", "position")

PROMPT_RANGE = (64, 1024)
RESPONSE_MU, RESPONSE_SIGMA = 6.5, 1.0
RESPONSE_RANGE = (16, 8192)
UNIFORM_RANGE = (64, 8192)


# ------------------------------------------------------------------ workloads


def lengths(workload: str, n: int, group_size: int, seed: int) -> np.ndarray:
    """``n`` sample lengths (int64) of ``workload``; with groups, one prompt length per group."""
    rng = np.random.default_rng(seed)
    if workload == "longtail":
        prompt = np.repeat(rng.integers(PROMPT_RANGE[0], PROMPT_RANGE[1] + 1, n // group_size), group_size)
        response = np.clip(np.round(rng.lognormal(RESPONSE_MU, RESPONSE_SIGMA, n)), *RESPONSE_RANGE)
        return prompt + response.astype(np.int64)
    if workload == "uniform":
        return rng.integers(UNIFORM_RANGE[0], UNIFORM_RANGE[1] + 1, n).astype(np.int64)
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


# ------------------------------------------------------------------ baseline


def greedy_heap(seqlens: list[int], k: int) -> list[list[int]]:
    """Equal-count greedy heap partition (the MindSpeed-RL sequence-length balancing).

    Lengths in descending order (ties: the larger position first) each go to
    the rank with the smallest sum, then fewest items, then lowest number; a
    rank that holds ``len(seqlens) // k`` items leaves the heap.
    """
    per_rank = len(seqlens) // k
    order = sorted(((x, i) for i, x in enumerate(seqlens)), reverse=True)
    heap: list[list[Any]] = [[0, 0, r, []] for r in range(k)]  # [sum, count, rank, items]
    full: list[list[Any]] = []
    for x, i in order:
        rank = heapq.heappop(heap)
        rank[0] += x
        rank[1] += 1
        rank[3].append(i)
        if rank[1] < per_rank:
            heapq.heappush(heap, rank)
        else:
            full.append(rank)
    return [sorted(r[3]) for r in sorted(full + heap, key=lambda r: r[2])]


def greedy_split(weights: np.ndarray, k: int, group_size: int) -> list[np.ndarray]:
    """`greedy_heap` on whole groups, expanded to sample positions."""
    items = weights.reshape(-1, group_size).sum(axis=1) if group_size > 1 else weights
    parts = greedy_heap(items.tolist(), k)
    offsets = np.arange(group_size, dtype=np.int64)
    return [(np.asarray(p, dtype=np.int64)[:, None] * group_size + offsets).ravel() for p in parts]


# ------------------------------------------------------------------ measurement


def position_split(n: int, k: int) -> list[np.ndarray]:
    """No balancing: rank r takes the r-th consecutive slice (a rank-aware get without balance_by)."""
    return list(np.arange(n, dtype=np.int64).reshape(k, n // k))


def _stats(weights: np.ndarray, parts: list[np.ndarray]) -> tuple[int, float]:
    sums = np.array([int(weights[p].sum()) for p in parts])
    hi, lo = int(sums.max()), int(sums.min())
    return hi - lo, (hi / lo if lo else float("inf"))


def _time_calls(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_case(workload: str, group_size: int, dp: int, count: int, *, batches: int, repeats: int) -> dict[str, Any]:
    """One case: both methods on ``batches`` random batches; per-batch figures and their medians."""
    n = dp * count
    per_batch: dict[str, dict[str, list[float]]] = {m: {"spread": [], "ratio": [], "seconds": []} for m in METHODS}
    for seed in range(batches):
        w = lengths(workload, n, group_size, seed)
        w_list = w.tolist()
        calls = {
            "dockd": functools.partial(balance, w, dp, group_size=group_size),
            "greedy": functools.partial(greedy_heap, w_list, dp) if group_size == 1 else
                      functools.partial(greedy_split, w, dp, group_size),
            "position": functools.partial(position_split, n, dp),
        }
        for method in METHODS:
            parts = [np.asarray(p, dtype=np.int64) for p in calls[method]()]  # also the warm-up call
            _check(parts, n, dp, count, group_size, method)
            spread, ratio = _stats(w, parts)
            per_batch[method]["spread"].append(spread)
            per_batch[method]["ratio"].append(ratio)
            per_batch[method]["seconds"].append(statistics.median(_time_calls(calls[method], repeats)))
    row: dict[str, Any] = {"workload": workload, "group_size": group_size, "dp": dp, "count": count,
                           "samples": n, "batches": batches, "repeats": repeats}
    for method in METHODS:
        b = per_batch[method]
        row[method] = {
            "spread": statistics.median(b["spread"]),
            "spread_max": max(b["spread"]),
            "ratio": statistics.median(b["ratio"]),
            "ms": statistics.median(b["seconds"]) * 1e3,
            "raw": b,
        }
    return row


def _check(parts: list[np.ndarray], n: int, dp: int, count: int, group_size: int, method: str) -> None:
    """Both methods must return a valid split, or the comparison means nothing."""
    flat = np.sort(np.concatenate(parts))
    if len(parts) != dp or any(len(p) != count for p in parts) or not np.array_equal(flat, np.arange(n)):
        raise RuntimeError(f"{method}: not an equal-count split of {n} samples into {dp} ranks")
    if group_size > 1 and any(len(np.unique(p // group_size)) != count // group_size for p in parts):
        raise RuntimeError(f"{method}: a group of {group_size} was split across ranks")


def run(*, workloads=WORKLOADS, groups=(1, 8), dps=(2, 4, 8, 16, 32), counts=(8, 64, 256),
        batches: int = 5, repeats: int = 5) -> list[dict[str, Any]]:
    """Every case of the grid; cases whose count is not a multiple of the group size are left out."""
    rows = []
    for workload in workloads:
        for g in groups:
            for dp in dps:
                for count in counts:
                    if count % g:
                        continue
                    rows.append(measure_case(workload, g, dp, count, batches=batches, repeats=repeats))
    return rows


# ------------------------------------------------------------------ report


def _fmt_ratio(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.5f}"


def _fmt_tokens(x: float) -> str:
    return f"{x:g}"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| workload | group | dp | per rank | by position max/min | dockd max/min | greedy max/min "
            "| dockd spread (worst) | greedy spread (worst) | dockd ms | greedy ms |")
    lines = [head, "|" + "---|" * 4 + "---:|" * 7]
    for r in rows:
        d, g = r["dockd"], r["greedy"]
        lines.append(
            f"| {r['workload']} | {r['group_size']} | {r['dp']} | {r['count']} "
            f"| {_fmt_ratio(r['position']['ratio'])} | {_fmt_ratio(d['ratio'])} | {_fmt_ratio(g['ratio'])} "
            f"| {_fmt_tokens(d['spread'])} ({_fmt_tokens(d['spread_max'])}) "
            f"| {_fmt_tokens(g['spread'])} ({_fmt_tokens(g['spread_max'])}) "
            f"| {d['ms']:.3f} | {g['ms']:.3f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.balance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--groups", type=_ints, default=(1, 8), help="group sizes (default 1,8)")
    ap.add_argument("--dp", type=_ints, default=(2, 4, 8, 16, 32), help="data-parallel sizes (default 2,4,8,16,32)")
    ap.add_argument("--counts", type=_ints, default=(8, 64, 256), help="samples per rank (default 8,64,256)")
    ap.add_argument("--batches", type=int, default=5, help="random batches per case (default 5)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per batch and method (default 5)")
    args = ap.parse_args(argv)
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workload(s) {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    if args.batches < 1 or args.repeats < 1:
        ap.error("--batches and --repeats must be at least 1")

    rows = run(workloads=workloads, groups=args.groups, dps=args.dp, counts=args.counts,
               batches=args.batches, repeats=args.repeats)
    print(f"## {TITLE}\n")
    print(f"dp ranks x 'per rank' samples each; medians over {args.batches} batches (worst spread in brackets); "
          f"ms = median time per call over {args.repeats} calls.\n")
    print(markdown(rows))
    if args.json_out:
        result = {
            "benchmark": NAME,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": {"workloads": list(workloads), "groups": list(args.groups), "dp": list(args.dp),
                       "counts": list(args.counts), "batches": args.batches, "repeats": args.repeats,
                       "longtail": {"prompt_range": PROMPT_RANGE, "response_mu": RESPONSE_MU,
                                    "response_sigma": RESPONSE_SIGMA, "response_range": RESPONSE_RANGE},
                       "uniform": {"range": UNIFORM_RANGE}},
            "machine": machine(),
            "versions": versions(),
            "rows": rows,
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
