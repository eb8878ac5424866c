"""Shared pieces of the benchmark scenarios: config, result rows, timing, machine info."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """Every knob of one benchmark run. The whole object is recorded in the JSON."""

    quick: bool = False
    """Tiny sizes, for tests and smoke runs. Numbers from a quick run mean nothing."""
    repeats: int = 5
    """Repeats per case; every figure reported is the median over them."""
    sample_sizes: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)
    """Bytes per sample for the dockd throughput matrix and the ceilings."""
    batch_sizes: tuple[int, ...] = (1, 64)
    """Samples per put / get call."""
    paths: tuple[str, ...] = ("shm", "socket")
    """dockd client data paths: same-host shared memory and plain socket."""
    concurrent_clients: tuple[int, ...] = (4,)
    """Client-process counts for the concurrent cases (one client is the main matrix)."""
    concurrent_sample_sizes: tuple[int, ...] = (64 * KiB, 1 * MiB)
    """Sample sizes for the concurrent-client cases (batch = the largest batch size)."""
    bytes_per_repeat: int = 256 * MiB
    """Payload moved per repeat of one case (at least one call is always made)."""
    max_ops_per_repeat: int = 256
    """Cap on put/get calls per repeat, so small-sample cases stay short."""
    latency_ops: int = 2000
    """Operations timed for the small-operation latency (p50/p99)."""
    latency_bytes: int = 64
    """Sample size for the latency cases."""
    flow_warehouses: int = 2
    """Warehouses started for the dockd_flow scenario."""
    peer_sample_sizes: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB)
    """Sample sizes of the shared peer workload."""
    peer_batch: int = 64
    """Samples per put / get in the shared peer workload."""
    peer_ops_per_repeat: int = 16
    """Put / get calls per repeat in the peer workload."""
    peer_grpo_batches: int = 16
    """Puts (and gets) of ``peer_batch`` GRPO-shaped samples per repeat of the peer workload's
    GRPO case (``benchmarks.columnar.grpo_samples``: 8 columns, ~31 KiB per sample); 0 skips it."""
    controller_partition_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    """Samples per partition for the controller-scale scenario."""
    controller_columns: int = 8
    controller_consumers: int = 6
    controller_acquire: int = 256
    """Samples per timed acquire."""
    controller_acquires_per_consumer: int = 16
    """Timed acquires per consumer and partition size."""
    scenario_timeout_s: float = 1800.0
    """Wall-clock limit for one scenario process."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        for name in ("sample_sizes", "batch_sizes", "peer_sample_sizes", "controller_partition_sizes"):
            values = getattr(self, name)
            if not values or any(int(v) <= 0 for v in values):
                raise ValueError(f"{name} must be non-empty positive integers, got {values!r}")
        if self.peer_grpo_batches < 0:
            raise ValueError(f"peer_grpo_batches must be >= 0, got {self.peer_grpo_batches}")
        unknown = set(self.paths) - {"shm", "socket"}
        if unknown:
            raise ValueError(f"Unknown dockd path(s) {sorted(unknown)}. Valid paths are: ['shm', 'socket']")

    @classmethod
    def quick_config(cls, **overrides: Any) -> BenchConfig:
        """Sizes small enough for a test to run every scenario in seconds."""
        values: dict[str, Any] = dict(
            quick=True,
            repeats=2,
            sample_sizes=(4 * KiB, 64 * KiB),
            batch_sizes=(1, 4),
            concurrent_clients=(2,),
            concurrent_sample_sizes=(4 * KiB,),
            bytes_per_repeat=1 * MiB,
            max_ops_per_repeat=8,
            latency_ops=20,
            flow_warehouses=1,
            peer_sample_sizes=(4 * KiB, 64 * KiB),
            peer_batch=4,
            peer_ops_per_repeat=2,
            peer_grpo_batches=2,
            controller_partition_sizes=(1_000, 4_000),
            controller_acquires_per_consumer=2,
            scenario_timeout_s=300.0,
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in names}
        return cls(**values)

    def ops_for(self, payload_bytes: int) -> int:
        """Calls per repeat that move about ``bytes_per_repeat`` (1..max_ops_per_repeat)."""
        return max(1, min(self.max_ops_per_repeat, self.bytes_per_repeat // max(1, payload_bytes)))


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclass(kw_only=True, slots=True)
class Row:
    """One measured case. Figures are medians over ``repeats``; raw values are kept."""

    scenario: str
    system: str
    """Who was measured: 'dockd', 'memcpy', 'socket', 'transferqueue', 'ray-actor', ..."""
    op: str
    """'put', 'get', 'copy', 'transfer', 'rtt', 'acquire', 'write', 'metadata'."""
    path: str | None = None
    sample_bytes: int | None = None
    batch: int | None = None
    clients: int = 1
    gbps: float | None = None
    """Payload gigabytes (10^9 bytes) per second."""
    samples_per_s: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    value: float | None = None
    """A figure without a unit above (e.g. metadata bytes per sample)."""
    unit: str | None = None
    repeats: int = 0
    raw: list[float] = field(default_factory=list)
    """Per-repeat values of the headline figure (GB/s, or µs for latency rows)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1)))))
    return float(ordered[rank])


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def throughput_row(
    *,
    scenario: str,
    system: str,
    op: str,
    seconds: list[float],
    nbytes: int,
    samples: int,
    path: str | None = None,
    sample_bytes: int | None = None,
    batch: int | None = None,
    clients: int = 1,
    extra: dict[str, Any] | None = None,
) -> Row:
    """Row from per-repeat wall times, each repeat moving ``nbytes`` in ``samples`` samples."""
    rates = [gbps(nbytes, s) for s in seconds]
    t_med = median(seconds)
    return Row(
        scenario=scenario,
        system=system,
        op=op,
        path=path,
        sample_bytes=sample_bytes,
        batch=batch,
        clients=clients,
        gbps=median(rates),
        samples_per_s=samples / t_med if t_med > 0 else None,
        repeats=len(seconds),
        raw=rates,
        extra={"bytes_per_repeat": nbytes, "samples_per_repeat": samples, "seconds": seconds, **(extra or {})},
    )


def latency_row(
    *,
    scenario: str,
    system: str,
    op: str,
    latencies_s: list[float],
    path: str | None = None,
    sample_bytes: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Row:
    us = [x * 1e6 for x in latencies_s]
    return Row(
        scenario=scenario,
        system=system,
        op=op,
        path=path,
        sample_bytes=sample_bytes,
        batch=1,
        p50_us=percentile(us, 50),
        p99_us=percentile(us, 99),
        samples_per_s=1e6 / percentile(us, 50),
        repeats=len(us),
        extra={"mean_us": statistics.fmean(us), "min_us": min(us), **(extra or {})},
    )


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    out = _git("rev-parse", "--short", "HEAD")
    return (out.stdout.strip() or None) if out is not None else None


def _git_dirty() -> bool | None:
    out = _git("status", "--porcelain", "--untracked-files=no", "--", "dockd", "benchmarks")
    return bool(out.stdout.strip()) if out is not None and out.returncode == 0 else None


def versions() -> dict[str, Any]:
    """Versions of everything a reader needs to reproduce the numbers."""
    pkgs = ["dockd", "torch", "numpy", "pyarrow", "msgpack", "uvloop", "grpcio", "ray", "transferqueue", "tensordict", "pyzmq"]
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "dockd_git": _git_commit(),
        "dockd_git_dirty": _git_dirty(),
        "packages": {name: _pkg_version(name) for name in pkgs},
    }


def machine() -> dict[str, Any]:
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem_total,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def set_single_thread() -> None:
    """One intra-op thread for torch: the design notes explain why (hangs, 50x slow copies)."""
    import torch

    torch.set_num_threads(1)


PAGE = 4096
_BYTE_AT = ctypes.c_ubyte.from_address
_DIRECT_BYTES = 16 * PAGE  # tensors up to this size are touched without numpy


def touch(obj: Any) -> int:
    """Read one byte of every 4 KiB page of every tensor in ``obj``; returns how many tensors.

    A get may hand back lazily mapped or zero-copy memory whose cost is paid
    on first access (page faults). Every timed get in these benchmarks, for
    every system alike, ends with this touch, so such deferred costs are
    counted; for memory already resident it costs a few microseconds per MiB
    and about half a microsecond per tensor (a get of 256 per-sample values:
    ~130 us).
    """
    import torch

    return _touch(obj, torch)


def _touch(obj: Any, torch: Any) -> int:
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:
            return sum(_touch(t, torch) for t in obj.unbind(0))
        _touch_tensor(obj, torch.strided)
        return 1
    if isinstance(obj, (list, tuple)):
        return sum(_touch(t, torch) for t in obj)
    if isinstance(obj, dict):
        return sum(_touch(t, torch) for t in obj.values())
    raise TypeError(f"touch() expects tensors or lists/dicts of them, got {type(obj).__name__}")


def _touch_tensor(t: Any, strided: Any) -> None:
    if t.is_cpu and t.layout is strided and t.is_contiguous() and t.nbytes <= _DIRECT_BYTES:
        # the bytes of the numpy path below (raw[::PAGE]), read where they lie: that path costs ~2 us a
        # tensor, which for a get of 256 per-sample 4 KiB values was more than dockd's whole get
        addr = t.data_ptr()
        end = addr + t.nbytes
        while addr < end:
            _BYTE_AT(addr).value  # noqa: B018 (the read is the point)
            addr += PAGE
        return
    import numpy as np

    if t.numel() == 0:
        return
    try:
        raw = t.detach().numpy().reshape(-1).view(np.uint8)  # a view when contiguous; numpy is cheap per call
    except (TypeError, RuntimeError, ValueError):  # bf16 and friends have no numpy dtype
        flat = t.detach().reshape(-1)
        flat[:: max(1, PAGE // flat.element_size())].sum()
        return
    if raw.size <= PAGE:
        int(raw[0])
    else:
        int(raw[::PAGE].sum())


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` on `cpus` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def spawn_env() -> dict[str, str]:
    """Environment for child processes: the repository on PYTHONPATH, one torch thread."""
    env = dict(os.environ)
    parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def put_get_round(dock: Any, size: int, batch: int, calls: int, tag: str,
                  timeout: float = 120.0) -> tuple[float, float, float]:
    """(put MB/s, puts/s, get MB/s): `calls` puts of `batch` samples of `size` random bytes to a fresh
    partition, then as many gets of `batch` by one consumer; the partition is cleared after."""
    import torch

    x = torch.randint(0, 255, (batch, size), dtype=torch.uint8)
    part = f"{tag}-{size}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    for _ in range(calls):
        dock.put({"x": x}, partition=part, timeout=timeout)
    t1 = time.perf_counter()
    for _ in range(calls):
        got = dock.get("c", ["x"], batch, partition=part, timeout=timeout)
        assert len(got["x"]) == batch
    t2 = time.perf_counter()
    dock.clear(part)
    mb = calls * batch * size / 1e6
    return mb / (t1 - t0), calls / (t1 - t0), mb / (t2 - t1)
