"""The one workload every peer runs: batched puts, then batched gets by one consumer.

Per sample size S (``config.peer_sample_sizes``) and batch B
(``config.peer_batch``), one repeat writes ``n`` batches of B samples of S
bytes into a fresh partition (each call acknowledged before the next), then
one consumer takes them back ``B`` at a time, reading one byte of every
4 KiB page of what it received (``common.touch``; lazily mapped results pay
their page faults inside the timed get); then the partition is cleared.
Put and get are timed separately; each figure is the median over
``config.repeats`` repeats. A small-operation pass then times single
``config.latency_bytes``-byte puts and gets (p50/p99).

The payload is a ``[B, S]`` uint8 tensor, converted once, outside the timed
region, into the form each system takes natively (a batched tensor, a
TensorDict, or a list of separate per-sample 1-D tensors).

Then the four-column case (issue 45's "4 KiB x 4-column get"): the same
workload with every sample four 4 KiB columns (``WIDE_COLUMNS``), each put
as one ``[B, 4096]`` uint8 tensor per column in one call
(:meth:`PeerAdapter.prepare_columns` turns them into each system's native
input, untimed), and every get takes all four columns, each value handed
over as its own per-sample tensor (as the one-column case does) and
touched. Its rows have ``extra.workload == "columns4"`` and no
``sample_bytes`` (16 KiB a sample: ``extra.mean_sample_bytes``).

Then the GRPO-shaped case (``config.peer_grpo_batches`` > 0): the samples of
``benchmarks.columnar.grpo_samples`` -- six ragged 1-D tensors of 128..2048
elements (prompt and response token ids int64; old and reference log-probs
and advantages float32; a bool response mask), a float reward and a string
uid, ~31 KiB of tensors per sample. One repeat puts ``peer_grpo_batches``
distinct batches of B samples, every column in one call, into a fresh
partition, then one consumer takes them back B at a time, every column;
every value of every column is handed over as its own object (per-sample
tensors, floats or strings; a scalar column may come back as one [B] tensor)
and every tensor value is touched like above. The batches are converted once,
untimed, into each system's native input (:meth:`PeerAdapter.prepare_columns`).
GB/s counts the tensor bytes only (as ``benchmarks.columnar`` does), the same
bytes for every system.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import Any

from ..common import BenchConfig, Row, latency_row, throughput_row, touch

logger = logging.getLogger(__name__)

CONSUMER = "bench"
COLUMN = "x"
PEER_LATENCY_OPS_CAP = 300
GRPO_WORKLOAD = "grpo"
"""``Row.extra["workload"]`` of the GRPO-shaped case's rows (their ``sample_bytes`` is None: ragged)."""
WIDE_WORKLOAD = "columns4"
"""``Row.extra["workload"]`` of the four-column case's rows (four 4 KiB columns a sample)."""
WIDE_COLUMNS = ("c0", "c1", "c2", "c3")
WIDE_COLUMN_BYTES = 4096
GRPO_TENSOR_COLUMNS = ("prompts", "responses", "old_log_probs", "ref_log_probs", "advantages", "response_mask")
GRPO_COLUMNS = GRPO_TENSOR_COLUMNS + ("reward", "uid")


class PeerAdapter(abc.ABC):
    """What a system must offer to run the peer workload."""

    system: str = "?"
    """Name in the result rows."""
    path: str | None = None
    """Data path label (``None`` when the system has only one)."""

    @abc.abstractmethod
    def start(self) -> dict[str, Any]:
        """Start or connect; return a description of the layout for the JSON."""

    def prepare(self, batch: Any) -> Any:
        """Turn the ``[B, S]`` uint8 tensor into the form this system takes natively (untimed)."""
        return batch

    @abc.abstractmethod
    def put(self, partition: str, batch: Any) -> None:
        """Write one prepared batch of B new samples; return once acknowledged."""

    @abc.abstractmethod
    def get(self, partition: str, consumer: str, count: int) -> Any:
        """Take ``count`` ready samples for ``consumer``; return their tensors (one per sample, or batched)."""

    def prepare_columns(self, columns: dict[str, list[Any]]) -> Any:
        """Turn one multi-column batch (column -> one value per sample: 1-D tensors, floats,
        strings; or one dense ``[B, S]`` tensor for a column of fixed-size samples) into the form
        this system takes natively (untimed)."""
        return columns

    def put_columns(self, partition: str, batch: Any) -> None:
        """Write one prepared multi-column batch of new samples; return once acknowledged."""
        raise NotImplementedError(f"{type(self).__name__} has no multi-column put")

    def get_columns(self, partition: str, consumer: str, columns: list[str], count: int) -> dict[str, Any]:
        """Take ``count`` samples ready in every one of ``columns``; return column -> values
        (one object per sample, a dense column's samples as separate tensors; a scalar column
        may be one [count] tensor)."""
        raise NotImplementedError(f"{type(self).__name__} has no multi-column get")

    @abc.abstractmethod
    def clear(self, partition: str) -> None:
        """Drop a partition and its data."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop what :meth:`start` started."""


def _ops(config: BenchConfig, sample_bytes: int) -> int:
    per_op = sample_bytes * config.peer_batch
    return max(2, min(config.peer_ops_per_repeat, config.bytes_per_repeat // per_op))


def run_workload(adapter: PeerAdapter, config: BenchConfig, scenario: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    layout = adapter.start()
    rows: list[Row] = []
    try:
        b = config.peer_batch
        for size in config.peer_sample_sizes:
            n = _ops(config, size)
            src = adapter.prepare(torch.full((b, size), 7, dtype=torch.uint8))
            # warm-up: one full round on a throwaway partition
            adapter.put(f"warm-{size}", src)
            got = touch(adapter.get(f"warm-{size}", CONSUMER, b))
            if got != b:
                raise RuntimeError(f"{adapter.system}: warm-up get returned {got} samples, expected {b}")
            adapter.clear(f"warm-{size}")
            put_s, get_s = [], []
            for rep in range(config.repeats):
                part = f"w-{size}-{rep}"
                t0 = time.perf_counter()
                for _ in range(n):
                    adapter.put(part, src)
                put_s.append(time.perf_counter() - t0)
                received = 0
                t0 = time.perf_counter()
                for _ in range(n):
                    received += touch(adapter.get(part, CONSUMER, b))
                get_s.append(time.perf_counter() - t0)
                if received != n * b:
                    raise RuntimeError(f"{adapter.system}: got {received} samples back, expected {n * b}")
                adapter.clear(part)
            for op, secs in (("put", put_s), ("get", get_s)):
                row = throughput_row(
                    scenario=scenario, system=adapter.system, op=op, path=adapter.path, seconds=secs,
                    nbytes=n * b * size, samples=n * b, sample_bytes=size, batch=b,
                    extra={"calls_per_repeat": n},
                )
                logger.info("[peers] system=%s op=%s size=%d batch=%d gbps=%.3f samples_per_s=%.0f",
                            adapter.system, op, size, b, row.gbps, row.samples_per_s)
                rows.append(row)
        rows += _latency(adapter, config, scenario)
        rows += _wide(adapter, config, scenario)
        if config.peer_grpo_batches > 0:
            rows += _grpo(adapter, config, scenario)
    finally:
        adapter.close()
    return {"rows": [r.to_dict() for r in rows], "layout": layout}


def run_wide(adapter: PeerAdapter, config: BenchConfig, scenario: str) -> dict[str, Any]:
    """The four-column case alone (see the module docstring), for a second configuration of one system."""
    import torch

    torch.set_num_threads(1)
    layout = adapter.start()
    try:
        rows = _wide(adapter, config, scenario)
    finally:
        adapter.close()
    return {"rows": [r.to_dict() for r in rows], "layout": layout}


def _latency(adapter: PeerAdapter, config: BenchConfig, scenario: str) -> list[Row]:
    import torch

    n = min(config.latency_ops, PEER_LATENCY_OPS_CAP)
    one = adapter.prepare(torch.full((1, config.latency_bytes), 3, dtype=torch.uint8))
    part = "lat"
    for _ in range(min(20, n)):  # warm-up
        adapter.put("lat-warm", one)
        touch(adapter.get("lat-warm", CONSUMER, 1))
    adapter.clear("lat-warm")
    put_lat, get_lat = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        adapter.put(part, one)
        put_lat.append(time.perf_counter() - t0)
    for _ in range(n):
        t0 = time.perf_counter()
        touch(adapter.get(part, CONSUMER, 1))
        get_lat.append(time.perf_counter() - t0)
    adapter.clear(part)
    rows = [
        latency_row(scenario=scenario, system=adapter.system, op=op, path=adapter.path, latencies_s=lat,
                    sample_bytes=config.latency_bytes)
        for op, lat in (("put", put_lat), ("get", get_lat))
    ]
    for r in rows:
        logger.info("[peers] system=%s op=%s latency p50_us=%.1f p99_us=%.1f", r.system, r.op, r.p50_us, r.p99_us)
    return rows


def touch_columns(cols: dict[str, Any], columns: tuple[str, ...] | list[str], count: int, system: str) -> int:
    """Touch every tensor value of every column (``touch``) and check each column has ``count`` values."""
    import torch

    for name in columns:
        values = cols[name]
        if isinstance(values, torch.Tensor):  # a nested (ragged) or dense [count, ...] column
            n = values.size(0)
            touch(values)
        else:
            values = list(values)
            n = len(values)
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            if tensors:
                touch(tensors)
        if n != count:
            raise RuntimeError(f"{system}: column {name!r} came back with {n} values, expected {count}")
    return count


def _grpo(adapter: PeerAdapter, config: BenchConfig, scenario: str) -> list[Row]:
    """The GRPO-shaped case: multi-column puts and gets of B ragged samples (see the module docstring)."""
    from ..columnar import grpo_samples, sample_bytes

    b = config.peer_batch
    n = config.peer_grpo_batches
    cols = list(GRPO_COLUMNS)
    data = grpo_samples(n * b)
    nbytes = sample_bytes(data)
    batches = [adapter.prepare_columns({k: v[i * b:(i + 1) * b] for k, v in data.items()}) for i in range(n)]
    return _columns_case(adapter, config, scenario, GRPO_WORKLOAD, cols, batches, nbytes)


def _wide(adapter: PeerAdapter, config: BenchConfig, scenario: str) -> list[Row]:
    """The four-column case: batches of B samples of four 4 KiB columns (see the module docstring)."""
    import torch

    b = config.peer_batch
    cols = list(WIDE_COLUMNS)
    n = _ops(config, WIDE_COLUMN_BYTES * len(cols))
    batch = adapter.prepare_columns(
        {c: torch.full((b, WIDE_COLUMN_BYTES), i + 1, dtype=torch.uint8) for i, c in enumerate(cols)})
    return _columns_case(adapter, config, scenario, WIDE_WORKLOAD, cols, [batch] * n,
                         n * b * WIDE_COLUMN_BYTES * len(cols))


def _columns_case(adapter: PeerAdapter, config: BenchConfig, scenario: str, workload: str, cols: list[str],
                  batches: list[Any], nbytes: int) -> list[Row]:
    """Time ``config.repeats`` rounds of: every prepared batch put into a fresh partition (each call
    acknowledged), then as many gets of B samples of every column in ``cols``, every value touched."""
    b = config.peer_batch
    n = len(batches)
    # warm-up: one batch on a throwaway partition
    adapter.put_columns(f"warm-{workload}", batches[0])
    touch_columns(adapter.get_columns(f"warm-{workload}", CONSUMER, cols, b), cols, b, adapter.system)
    adapter.clear(f"warm-{workload}")
    put_s, get_s = [], []
    for rep in range(config.repeats):
        part = f"{workload}-{rep}"
        t0 = time.perf_counter()
        for batch in batches:
            adapter.put_columns(part, batch)
        put_s.append(time.perf_counter() - t0)
        received = 0
        t0 = time.perf_counter()
        for _ in range(n):
            received += touch_columns(adapter.get_columns(part, CONSUMER, cols, b), cols, b, adapter.system)
        get_s.append(time.perf_counter() - t0)
        if received != n * b:
            raise RuntimeError(f"{adapter.system}: got {received} {workload} samples back, expected {n * b}")
        adapter.clear(part)
    rows = []
    for op, secs in (("put", put_s), ("get", get_s)):
        row = throughput_row(
            scenario=scenario, system=adapter.system, op=op, path=adapter.path, seconds=secs,
            nbytes=nbytes, samples=n * b, sample_bytes=None, batch=b,
            extra={"workload": workload, "calls_per_repeat": n, "columns": cols,
                   "mean_sample_bytes": nbytes / (n * b)},
        )
        logger.info("[peers] system=%s op=%s workload=%s batch=%d gbps=%.3f samples_per_s=%.0f",
                    adapter.system, op, workload, b, row.gbps, row.samples_per_s)
        rows.append(row)
    return rows
