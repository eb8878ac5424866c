"""The columnar data plane: many columns, ragged values, small to medium samples.

Cases (real local daemons, one client, the public API only):

- memory: ``mem_samples`` samples x 4 columns x 16 B, put as batched tensors
  of ``mem_put`` samples; the warehouse process's RSS growth minus the payload,
  per stored value, and the whole dock's per sample (controller included:
  it runs in the same process here).
- put rate of that workload (samples/s).
- multi-column gets: 4 columns x 4 KiB against 1 column x 16 KiB (the same
  bytes per sample), 256 samples per get: time per sample and their ratio,
  once taking every value as its own tensor (`batch[column]`: 4x the objects
  for the multi-column case) and once each column as one tensor
  (`batch.stacked(column)`).
- a GRPO-shaped sample: prompt and response token ids (int64), old and
  reference log-probs and advantages (float32), a response mask (bool), each
  a ragged 1-D tensor of 128..2048 elements, a float reward and a string uid
  (~31 KiB on average); puts and gets of 64, every value of every column
  taken as its own object (`batch[column]`). Next to it, a single-thread
  memcpy of the same bytes in the same run (the ceiling).
- same-host puts of 1 MiB and 16 MiB samples (one per put, warm: after a
  few puts of the same size), against memcpy into warm memory.

Each figure is the median of ``repeats`` repeats.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

NAME = "columnar"
TITLE = "Columnar data plane: memory per value, multi-column and GRPO-shaped samples vs memcpy"


def requirements() -> str | None:
    try:
        import dockd  # noqa: F401
    except ImportError as exc:
        return f"dockd is not importable ({exc})"
    return None


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


TENSORS = ("prompts", "responses", "old_log_probs", "ref_log_probs", "advantages", "response_mask")


def grpo_samples(n: int, seed: int = 0) -> dict[str, list[Any]]:
    """n GRPO-shaped samples: six ragged 1-D tensors of 128..2048 elements, a reward, a uid."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    plen = rng.integers(128, 2049, n)
    rlen = rng.integers(128, 2049, n)
    out: dict[str, list[Any]] = {k: [] for k in ("prompts", "responses", "old_log_probs", "ref_log_probs",
                                                 "advantages", "response_mask", "reward", "uid")}
    for i in range(n):
        out["prompts"].append(torch.randint(0, 32000, (int(plen[i]),), generator=g))
        out["responses"].append(torch.randint(0, 32000, (int(rlen[i]),), generator=g))
        for k in ("old_log_probs", "ref_log_probs", "advantages"):
            out[k].append(torch.randn(int(rlen[i]), generator=g))
        out["response_mask"].append(torch.ones(int(rlen[i]), dtype=torch.bool))
        out["reward"].append(float(rng.random()))
        out["uid"].append(f"prompt-{i // 8}-resp-{i % 8}")
    return out


def sample_bytes(cols: dict[str, list[Any]]) -> int:
    return sum(v.numel() * v.element_size() for vs in cols.values() for v in vs if isinstance(v, torch.Tensor))


def memcpy_gbps(nbytes: int, repeats: int = 5, working_set: int = 256 << 20) -> float:
    """Single-thread copy of `nbytes` into warm (already faulted) memory, cycling through a
    working set larger than the caches, as a stream of samples does."""
    k = max(2, working_set // max(nbytes, 1))
    srcs = [torch.empty(nbytes, dtype=torch.uint8).fill_(1) for _ in range(k)]
    dsts = [torch.empty_like(s).fill_(0) for s in srcs]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s, d in zip(srcs, dsts):
            d.copy_(s)
        times.append((time.perf_counter() - t0) / k)
    return nbytes / statistics.median(times) / 1e9


GRPO_BATCH = 64


def as_jagged(data: dict[str, list[Any]]) -> dict[str, Any]:
    """The ragged columns of `data` as jagged nested tensors (one values buffer plus offsets each)."""
    return {k: torch.nested.as_nested_tensor(v, layout=torch.jagged) if k in TENSORS else v for k, v in data.items()}


_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def read_all(t: torch.Tensor) -> int:
    """Read every byte of a tensor's buffer (a consumer that uses the data), as the widest integer words its
    size and address divide into. (Read byte by byte, as this did for any size not a multiple of 8, the
    ~280 KB of a float32 column of an odd number of elements took 127 us against 7 us as int32 words: the
    three float32 columns of a GRPO batch cost 0.38 ms of a 2.3 ms jagged get.)"""
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    dtype = next(dt for dt, w in _WORDS if n % w == 0 and flat.data_ptr() % w == 0)
    return int(flat.view(dtype).sum())


def _grpo(d, data: dict[str, list[Any]], repeats: int, *, jagged: bool) -> dict[str, float]:
    """GRPO-shaped puts and gets of GRPO_BATCH samples: every value of every column as its own object
    (`batch[column]`, the list API), or (`jagged`) each ragged column put as a jagged nested tensor and
    got as one (`batch.jagged(column)`), its values read by the consumer."""
    n, batch = len(data["uid"]), GRPO_BATCH
    nbytes = sample_bytes(data)
    chunks = [{k: v[s:s + batch] for k, v in data.items()} for s in range(0, n, batch)]
    if jagged:
        chunks = [as_jagged(c) for c in chunks]
    put_t, get_t = [], []
    for r in range(repeats):
        part = f"grpo-{'jagged' if jagged else 'lists'}-{r}"
        t0 = time.perf_counter()
        for c in chunks:
            d.put(c, partition=part)
        put_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = 0
        for _ in range(n // batch):
            b = d.get("trainer", list(data), batch, partition=part, timeout=60)
            for k in data:
                if not jagged:
                    assert len(b[k]) == batch  # every value of every column as its own object (the list API)
                elif k in TENSORS:
                    read_all(b.jagged(k).values())
                else:
                    assert len(b[k]) == batch
            got += len(b)
        get_t.append(time.perf_counter() - t0)
        assert got == n
        d.clear(part)
    key = "grpo_jagged" if jagged else "grpo"
    return {"grpo_bytes_per_sample": nbytes / n,
            f"{key}_put_samples_per_s": n / statistics.median(put_t), f"{key}_get_samples_per_s": n / statistics.median(get_t),
            f"{key}_put_GBps": nbytes / statistics.median(put_t) / 1e9, f"{key}_get_GBps": nbytes / statistics.median(get_t) / 1e9}


def _memory(d, pid: int, quick: bool) -> dict[str, float]:
    """Memory per stored value and the put rate of 4 x 16 B columns put 1,000 samples at a time."""
    mem_samples, mem_put = (20_000, 1000) if quick else (200_000, 1000)
    cols = {f"c{k}": torch.full((mem_put, 4), k, dtype=torch.float32) for k in range(4)}  # 16 B per value
    d.put(cols, partition="warm")
    d.clear("warm")
    time.sleep(0.5)
    before = _rss(pid)
    t0 = time.perf_counter()
    for _ in range(mem_samples // mem_put):
        d.put(cols, partition="mem")
    put_s = time.perf_counter() - t0
    time.sleep(0.5)
    grown = _rss(pid) - before
    payload = mem_samples * 4 * 16
    d.clear("mem")
    return {"mem_overhead_per_value_B": (grown - payload) / (mem_samples * 4),
            "mem_dock_per_sample_B": (grown - payload) / mem_samples, "mem_put_samples_per_s": mem_samples / put_s}


def _multi(d, quick: bool, repeats: int) -> dict[str, float]:
    """Multi-column (4 x 4 KiB) vs single-column (1 x 16 KiB) gets, as lists and as stacked columns."""
    res: dict[str, float] = {}
    n_get, per = (1024 if quick else 8192), 256
    multi = {f"m{k}": torch.randn(n_get, 1024) for k in range(4)}  # 4 x 4 KiB
    single = {"s": torch.randn(n_get, 4096)}                          # 1 x 16 KiB
    for how in ("lists", "stacked"):  # one tensor per value (the list API), or one per column
        for name, src in (("multi", multi), ("single", single)):
            times = []
            for r in range(repeats):
                part = f"{name}-{how}-{r}"
                for s in range(0, n_get, per):
                    d.put({k: v[s:s + per] for k, v in src.items()}, partition=part)
                t0 = time.perf_counter()
                for _ in range(n_get // per):
                    b = d.get("c", list(src), per, partition=part, timeout=60)
                    for k in src:
                        assert (len(b[k]) if how == "lists" else b.stacked(k).shape[0]) == per
                times.append((time.perf_counter() - t0) / n_get)
                d.clear(part)
            res[f"get_{name}_{how}_us_per_sample"] = statistics.median(times) * 1e6
        res[f"get_multi_vs_single_{how}"] = (res[f"get_multi_{how}_us_per_sample"]
                                             / res[f"get_single_{how}_us_per_sample"])
    return res


def _big(d, quick: bool, repeats: int) -> dict[str, float]:
    """Same-host puts of 1 MiB and 16 MiB samples, one per put, into warm segments, against memcpy."""
    res: dict[str, float] = {}
    for mib in (1, 16):
        size = mib << 20
        x = torch.randint(0, 255, (1, size), dtype=torch.uint8)
        n = 8 if quick else (64 if mib == 1 else 16)
        for _ in range(n):  # (as many as a repeat puts: each repeat then finds the warehouse's segments warm)
            d.put({"x": x}, partition=f"big{mib}-warm")
        d.clear(f"big{mib}-warm")
        times = []
        for r in range(repeats):
            part = f"big{mib}-{r}"
            t0 = time.perf_counter()
            for _ in range(n):
                d.put({"x": x}, partition=part)
            times.append((time.perf_counter() - t0) / n)
            d.clear(part)
        res[f"put_{mib}MiB_GBps"] = size / statistics.median(times) / 1e9
        res[f"memcpy_{mib}MiB_GBps"] = memcpy_gbps(size)
        res[f"put_{mib}MiB_vs_memcpy"] = res[f"put_{mib}MiB_GBps"] / res[f"memcpy_{mib}MiB_GBps"]
    return res


def measure(*, quick: bool = False, repeats: int = 3, only: str = "memory,multi,grpo,big") -> dict[str, Any]:
    """The cases named in `only` (comma-separated: memory, multi, grpo, big)."""
    import dockd

    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    cases = set(only.split(","))
    with dockd.start_local(1, capacity="8GiB") as cluster, dockd.connect(cluster.address) as d:
        if "memory" in cases:
            res.update(_memory(d, cluster.procs[0].pid, quick))
        if "multi" in cases:
            res.update(_multi(d, quick, repeats))
        if "grpo" in cases:  # per-sample lists (today's API), and jagged columns
            data = grpo_samples(256 if quick else 2048)
            res.update(_grpo(d, data, repeats, jagged=False))
            res.update(_grpo(d, data, repeats, jagged=True))
            res["memcpy_grpo_batch_GBps"] = memcpy_gbps(int(res["grpo_bytes_per_sample"] * GRPO_BATCH))
            for key in ("grpo_put", "grpo_get", "grpo_jagged_put", "grpo_jagged_get"):
                res[f"{key}_vs_memcpy"] = res[f"{key}_GBps"] / res["memcpy_grpo_batch_GBps"]
        if "big" in cases:
            res.update(_big(d, quick, repeats))
    return res


_UNITS = (("_us_per_sample", "us/sample"), ("_samples_per_s", "samples/s"), ("_bytes_per_sample", "B/sample"),
          ("_GBps", "GB/s"), ("_B", "B"))


def _unit(key: str) -> str:
    """The unit of one measured figure, from its key's suffix; anything else is a ratio."""
    return next((unit for suffix, unit in _UNITS if key.endswith(suffix)), "x")


def run(config) -> dict:
    from .common import Row

    res = measure(quick=config.quick, repeats=config.repeats)
    rows = []
    for key, v in res.items():
        system = "memcpy" if key.startswith("memcpy") else "dockd"
        op = "put" if "put" in key else "get" if "get" in key else "copy" if system == "memcpy" else "metadata"
        unit = _unit(key)
        rows.append(Row(scenario=NAME, system=system, op=op, path=key, value=float(v), unit=unit).to_dict())
    return {"rows": rows, "measured": res}


if __name__ == "__main__":  # a standalone run: python -m benchmarks.columnar [--quick] [--only=grpo,big]
    import json
    import sys

    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), "memory,multi,grpo,big")
    print(json.dumps(measure(quick="--quick" in sys.argv, only=only), indent=1))
    os._exit(0)
