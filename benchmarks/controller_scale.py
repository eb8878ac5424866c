"""Controller scale: acquire(256) against partitions of 10^4 .. 10^6 samples, in-process.

For each partition size N a fresh ``dockd.controller.core.Controller`` (pure
logic, no sockets) gets N samples x 8 columns the way a pipeline writes
them: the first column creates the samples in chunks of 1024 (placed on 4
warehouses round-robin), then each further column is committed for existing
indexes, chunk by chunk. Six consumers, each asking for a different subset
of the columns (3..8), then take the partition 256 samples at a time; the
timed acquires are spread over the whole partition (untimed bulk acquires
skip ahead between them), each followed by its confirm.

Reported per N: acquire p50/p99 (µs; each consumer's first acquire, which
sets up its view of the partition, is also listed on its own), write
throughput (sample-columns/s),
and metadata bytes per sample from the controller's own accounting
(``metadata_bytes``) next to the process's resident-memory growth per sample
as a cross-check.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from .common import BenchConfig, Row, latency_row, rss_bytes

logger = logging.getLogger(__name__)

NAME = "controller_scale"
TITLE = "Controller: acquire(256) vs partition size, metadata bytes per sample (in-process)"

WRITE_CHUNK = 1024
WAREHOUSES = 4
SKIP_CHUNK = 65536


def requirements() -> str | None:
    try:
        from dockd.controller.core import Controller  # noqa: F401
    except ImportError as exc:
        return f"dockd.controller.core.Controller is not importable ({exc})"
    return None


class ControllerAdapter:
    """The few controller calls this scenario makes, in one place."""

    def __init__(self) -> None:
        from dockd.controller.core import Controller

        self.ctl = Controller(lease_timeout=3600.0)

    def create(self, partition: str, column: str, count: int, warehouse: int) -> Any:
        return self.ctl.commit(partition, [column], warehouse=warehouse, new_count=count, nbytes=count * 64)

    def add_column(self, partition: str, column: str, indexes: Any, warehouse: int) -> None:
        self.ctl.commit(partition, [column], warehouse=warehouse, indexes=indexes, nbytes=len(indexes) * 64)

    def acquire(self, partition: str, consumer: str, columns: list[str], count: int) -> tuple[int, int]:
        res = self.ctl.acquire(partition, consumer, columns, count)
        if res is None:
            raise RuntimeError(f"controller had fewer than {count} samples ready for {consumer}")
        return res.lease, len(res.indexes)

    def confirm(self, lease: int) -> None:
        self.ctl.confirm(lease)

    def metadata_bytes(self, partition: str) -> int:
        return int(self.ctl.metadata_bytes(partition))


def measure(n_samples: int, config: BenchConfig) -> list[Row]:
    part = "p"
    columns = [f"c{i}" for i in range(config.controller_columns)]
    gc.collect()
    rss0 = rss_bytes()
    ad = ControllerAdapter()
    t0 = time.perf_counter()
    chunks = []
    for k, start in enumerate(range(0, n_samples, WRITE_CHUNK)):
        count = min(WRITE_CHUNK, n_samples - start)
        wh = k % WAREHOUSES
        chunks.append((ad.create(part, columns[0], count, wh), wh))
    for col in columns[1:]:
        for idx, wh in chunks:
            ad.add_column(part, col, idx, wh)
    write_s = time.perf_counter() - t0
    meta_written = ad.metadata_bytes(part)
    del chunks

    acquire = config.controller_acquire
    per_consumer = max(1, min(config.controller_acquires_per_consumer, n_samples // acquire))
    stride = (n_samples - per_consumer * acquire) // per_consumer
    lat: list[float] = []
    first: list[float] = []
    for c in range(config.controller_consumers):
        consumer = f"consumer{c}"
        cols = columns[: min(len(columns), 3 + c)]
        for k in range(per_consumer):
            t = time.perf_counter()
            lease, got = ad.acquire(part, consumer, cols, acquire)
            lat.append(time.perf_counter() - t)
            if k == 0:
                first.append(lat[-1])
            ad.confirm(lease)
            left = stride
            while left > 0:  # skip ahead, untimed
                lease, got = ad.acquire(part, consumer, cols, min(left, SKIP_CHUNK))
                ad.confirm(lease)
                left -= got
    meta_all = ad.metadata_bytes(part)
    gc.collect()
    rss_per_sample = (rss_bytes() - rss0) / n_samples
    extra = {"partition_samples": n_samples, "columns": len(columns), "consumers": config.controller_consumers}
    acq = latency_row(scenario=NAME, system="dockd-controller", op="acquire", latencies_s=lat,
                      extra={**extra, "acquires_timed": len(lat), "stride": stride,
                             "first_acquire_per_consumer_us": [x * 1e6 for x in first]})
    acq.batch = acquire
    acq.samples_per_s = acquire * 1e6 / acq.p50_us
    write = Row(
        scenario=NAME, system="dockd-controller", op="write", batch=WRITE_CHUNK,
        samples_per_s=n_samples / write_s, repeats=1, raw=[write_s],
        extra={**extra, "seconds": write_s, "sample_columns_per_s": n_samples * len(columns) / write_s},
    )
    meta = Row(
        scenario=NAME, system="dockd-controller", op="metadata", value=meta_all / n_samples, unit="B/sample",
        repeats=1,
        extra={**extra, "metadata_bytes": meta_all, "metadata_bytes_after_writes": meta_written,
               "bytes_per_sample_after_writes": meta_written / n_samples,
               "rss_growth_bytes_per_sample": rss_per_sample},
    )
    logger.info("[controller] n=%d acquire p50_us=%.1f p99_us=%.1f meta_B_per_sample=%.1f rss_B_per_sample=%.1f",
                n_samples, acq.p50_us, acq.p99_us, meta.value, rss_per_sample)
    del ad
    gc.collect()
    return [acq, write, meta]


def run(config: BenchConfig) -> dict[str, Any]:
    rows: list[Row] = []
    for n in config.controller_partition_sizes:
        rows += measure(int(n), config)
    return {
        "rows": [r.to_dict() for r in rows],
        "write_chunk": WRITE_CHUNK,
        "warehouses": WAREHOUSES,
        "acquire": config.controller_acquire,
    }
