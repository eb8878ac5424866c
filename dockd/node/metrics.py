"""Prometheus metrics of a daemon (`dockd serve --metrics-port PORT`).

The hot path only does integer arithmetic on a `Metrics` object: no locks, no
label lookups, no prometheus_client call per request. The registry is private
to the daemon and filled at scrape time by `NodeCollector`, which reads these
counters and a few live figures of the node (`NodeFigures`), so a cleared
partition's series vanish by themselves and the series count stays bounded. The endpoint is served on the
daemon's own event loop, so a scrape never reads state while the loop changes
it (and a wedged loop shows as a failed scrape, which is what it is).

Series (all prefixed `dockd_`):

    build_info{version,controller,warehouse}            1
    put_samples_total / put_bytes_total{transport}      stored by this warehouse
    puts_before_commit_total                            puts answered before their commit (--commit-window)
    get_samples_total / get_bytes_total{transport}      served by this warehouse
    request_seconds{op}                                 histogram: request in to reply out
    request_errors_total{op,error}                      requests answered with an error
    warehouse_used_bytes / _capacity_bytes / _reserved_bytes / _metadata_bytes
    warehouse_device_used_bytes / _capacity_bytes       the device tier (when it has one)
    device_spilled_bytes_total                          put(device="keep") bytes stored in host memory instead
    device_shared_bytes_total                           device-tier bytes read through shared device memory
    device_linked_bytes_total                           device-tier bytes sent over device links (other nodes)
    device_links                                        device links open (cross-node device reads)
    spill_out_bytes_total                               --spill-dir: bytes of stored puts spilled out of memory
    spill_restored_bytes_total                          ... brought back into memory by a fetch (restored)
    spill_read_bytes_total                              ... read for a reply straight from their file (no room)
    warehouse_spilled_bytes                             ... bytes of stored puts out of memory now
    spill_file_bytes / spill_capacity_bytes             ... bytes in spill files now, and --spill-capacity (0: the disk)
    connections                                         open connections
    auth_failures_total{reason}
    controller only:
    warehouses{state}                                   joined / unresponsive / rejoining / lost / left
    waiters{consumer}                                   gets blocked in the controller
    leases_expired_total
    partitions                                          partitions held
    partition_samples{partition}
    partition_deleted_samples{partition}
    consumer_taken_samples / _leased_samples / _ready_samples{partition,consumer}
    partition_policy_version{partition}                 the trainer's version (set_version)
    partition_pending_samples{partition}                not yet handed to all its consumers (max_pending bounds it)
    partition_stale_samples{partition}                  too stale to be handed out (max_staleness), not taken
    partition_stale_retired_samples{partition}          deleted by set_version (retire_stale)
    paced_puts_waiting{partition}                       puts waiting for max_pending
    paced_puts_total                                    puts that had to wait for max_pending
    sample_staleness                                    histogram: trainer version minus version of samples handed out

`transport` is `shm` for same-host clients (Unix socket, shared memory),
`mooncake` for gets whose bytes readers pulled with the Mooncake Transfer Engine
(`dockd serve --transport mooncake|auto`; bytes such a get still carried in the
frame body count as `tcp`), and `tcp` otherwise. A get whose columns live on two warehouses counts on both.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from dockd._version import __version__
from dockd.controller.grants import STALENESS_BUCKETS

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from dockd.controller.service import ControllerService

logger = logging.getLogger(__name__)

#: Upper bounds (seconds) of the request histogram's buckets: sub-millisecond small requests
#: up to gets that wait minutes for data.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0, 120.0)
#: Partitions (most recently created first) whose progress series the controller exports.
MAX_PARTITIONS = 32
TRANSPORTS = ("shm", "tcp", "mooncake")


class Histogram:
    """Counts per bucket and a sum, as plain numbers."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, run = [], 0
        for bound, n in zip((*map(repr, BUCKETS), "+Inf"), self.counts):
            run += n
            out.append((bound, run))
        return out


class Metrics:
    """What a daemon counts as it serves (see the module docstring for the exported names)."""

    def __init__(self) -> None:
        self.put_samples = dict.fromkeys(TRANSPORTS, 0)
        self.put_bytes = dict.fromkeys(TRANSPORTS, 0)
        self.get_samples = dict.fromkeys(TRANSPORTS, 0)
        self.get_bytes = dict.fromkeys(TRANSPORTS, 0)
        self.requests: dict[str, Histogram] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.spilled_bytes = 0  # device-tier puts stored in host memory instead
        self.device_shared_bytes = 0  # device-tier bytes fetched as shared device memory
        self.device_linked_bytes = 0  # device-tier bytes sent over device links
        self.spill_out_bytes = 0  # stored puts spilled to files (dockd.warehouse.spill)
        self.spill_restored_bytes = 0  # spilled puts restored into memory by a fetch
        self.spill_read_bytes = 0  # spilled puts read for a reply without restoring them
        self.puts_before_commit = 0  # puts answered before their commit (--commit-window)

    def put(self, shm: bool, samples: int, nbytes: int) -> None:
        t = "shm" if shm else "tcp"
        self.put_samples[t] += samples
        self.put_bytes[t] += nbytes

    def get(self, shm: bool, samples: int, nbytes: int) -> None:
        t = "shm" if shm else "tcp"
        self.get_samples[t] += samples
        self.get_bytes[t] += nbytes

    def got(self, transport: str, samples: int, nbytes: int) -> None:
        """A get served over `transport` (one of TRANSPORTS)."""
        self.get_samples[transport] += samples
        self.get_bytes[transport] += nbytes

    def request(self, op: str, seconds: float) -> None:
        h = self.requests.get(op)
        if h is None:
            h = self.requests[op] = Histogram()
        h.observe(seconds)

    def error(self, op: str, exc: BaseException) -> None:
        key = (op, type(exc).__name__)
        self.errors[key] = self.errors.get(key, 0) + 1


class WarehouseUsage(Protocol):
    """A warehouse's room, in bytes (`dockd.warehouse.core.Warehouse` is one)."""

    used: int
    capacity: int
    reserved: int
    meta: int
    device_used: int
    device_capacity: int
    spilled: int

    @property
    def spill_figures(self) -> tuple[int, int] | None:
        """With a spill tier: (bytes in spill files, --spill-capacity); else None."""


class NodeFigures(Protocol):
    """What the metrics (and the admin Stats call) read of a daemon: its counters and a few live figures."""

    metrics: Metrics

    @property
    def wid(self) -> int:
        """This node's warehouse id (-1: none, or not joined yet)."""

    @property
    def warehouse(self) -> WarehouseUsage | None:
        """The warehouse's room (None: this daemon runs no warehouse)."""

    @property
    def controller(self) -> ControllerService | None:
        """The controller hosted in this process, or None."""

    @property
    def connections(self) -> int: ...

    @property
    def device_links(self) -> int: ...

    @property
    def auth_failures(self) -> Mapping[str, int]: ...


class NodeCollector:
    """Turns a node's counters and state into metric families at scrape time."""

    def __init__(self, node: NodeFigures) -> None:
        self.node = node

    def collect(self):
        node, m = self.node, self.node.metrics
        info = GaugeMetricFamily("dockd_build_info", "dockd version and the roles of this daemon",
                                 labels=["version", "controller", "warehouse"])
        info.add_metric([__version__, str(node.controller is not None).lower(), str(node.wid)], 1)
        yield info
        for name, values, what in (
            ("put_samples", m.put_samples, "samples stored by this warehouse"),
            ("put_bytes", m.put_bytes, "payload bytes stored by this warehouse"),
            ("get_samples", m.get_samples, "samples served by this warehouse (a get spanning warehouses counts on each)"),
            ("get_bytes", m.get_bytes, "payload bytes served by this warehouse"),
        ):
            fam = CounterMetricFamily(f"dockd_{name}", what, labels=["transport"])
            for transport, v in values.items():
                fam.add_metric([transport], v)
            yield fam
        hist = HistogramMetricFamily("dockd_request_seconds", "time from a request's arrival to its reply, by operation",
                                     labels=["op"])
        for op, h in sorted(m.requests.items()):
            hist.add_metric([op], h.cumulative(), h.total)
        yield hist
        errs = CounterMetricFamily("dockd_request_errors", "requests answered with an error", labels=["op", "error"])
        for (op, err), n in sorted(m.errors.items()):
            errs.add_metric([op, err], n)
        yield errs
        w = node.warehouse
        if w is not None:
            yield from _warehouse_families(w, m, node.device_links)
        yield GaugeMetricFamily("dockd_connections", "open connections", value=node.connections)
        fails = CounterMetricFamily("dockd_auth_failures", "connections or calls refused for want of a valid proof",
                                    labels=["reason"])
        for reason, n in sorted(node.auth_failures.items()):
            fails.add_metric([reason], n)
        yield fails
        if node.controller is not None:
            yield from _controller_families(node.controller)


def _warehouse_families(w: WarehouseUsage, m: Metrics, device_links: int) -> Iterator[Metric]:
    yield GaugeMetricFamily("dockd_warehouse_used_bytes", "payload bytes stored", value=w.used)
    yield GaugeMetricFamily("dockd_warehouse_capacity_bytes", "bytes stored before puts wait", value=w.capacity)
    yield GaugeMetricFamily("dockd_warehouse_reserved_bytes", "bytes of puts in flight", value=w.reserved)
    yield GaugeMetricFamily("dockd_warehouse_metadata_bytes", "bookkeeping of stored puts, counted against "
                            "the capacity", value=w.meta)
    if w.device_capacity:
        yield GaugeMetricFamily("dockd_warehouse_device_used_bytes", "device-tier bytes stored",
                                value=w.device_used)
        yield GaugeMetricFamily("dockd_warehouse_device_capacity_bytes", "device-tier bytes it holds",
                                value=w.device_capacity)
    yield CounterMetricFamily("dockd_puts_before_commit", "puts answered once stored, before their commit "
                              "(--commit-window)", value=m.puts_before_commit)
    yield CounterMetricFamily("dockd_device_spilled_bytes", "device-run bytes stored in host memory "
                              "instead (device tier full or absent)", value=m.spilled_bytes)
    yield CounterMetricFamily("dockd_device_shared_bytes", "device-tier bytes read by same-node readers "
                              "through shared device memory", value=m.device_shared_bytes)
    yield CounterMetricFamily("dockd_device_linked_bytes", "device-tier bytes sent to readers on other nodes "
                              "over device links", value=m.device_linked_bytes)
    yield GaugeMetricFamily("dockd_device_links", "device links open (cross-node device reads)",
                            value=device_links)
    spill = w.spill_figures
    if spill is not None:
        yield CounterMetricFamily("dockd_spill_out_bytes", "bytes of stored puts spilled out of memory to files "
                                  "(--spill-dir)", value=m.spill_out_bytes)
        yield CounterMetricFamily("dockd_spill_restored_bytes", "bytes of spilled puts brought back into memory by "
                                  "a fetch", value=m.spill_restored_bytes)
        yield CounterMetricFamily("dockd_spill_read_bytes", "bytes of spilled puts read for a reply straight from "
                                  "their file (no room to restore them)", value=m.spill_read_bytes)
        yield GaugeMetricFamily("dockd_warehouse_spilled_bytes", "bytes of stored puts out of memory now (in spill "
                                "files, or in data-dir files only)", value=w.spilled)
        yield GaugeMetricFamily("dockd_spill_file_bytes", "bytes in spill files now", value=spill[0])
        yield GaugeMetricFamily("dockd_spill_capacity_bytes", "--spill-capacity (0: the disk's free space less "
                                "a margin)", value=spill[1])


def _controller_families(ctl: ControllerService) -> Iterator[Metric]:
    """The controller's figures, from what its stats() reports to clients and its counters."""
    st = ctl.stats()
    states = {"joined": 0, "unresponsive": 0, "rejoining": 0, "lost": 0, "left": 0}
    for info in st.warehouses:
        state = info.state or "joined"
        states[state] = states.get(state, 0) + 1
    fam = GaugeMetricFamily("dockd_warehouses", "warehouses known to the controller, by state", labels=["state"])
    for state, n in states.items():
        fam.add_metric([state], n)
    yield fam
    waiting: dict[str, int] = {}
    for (_, consumer), n in ctl.waiting_by_consumer().items():
        waiting[consumer] = waiting.get(consumer, 0) + n
    fam = GaugeMetricFamily("dockd_waiters", "gets blocked in the controller, by consumer", labels=["consumer"])
    for c, n in sorted(waiting.items()):
        fam.add_metric([c], n)
    yield fam
    yield CounterMetricFamily("dockd_leases_expired", "leases that expired unconfirmed (their samples went back)",
                              value=ctl.leases_expired)
    yield GaugeMetricFamily("dockd_partitions", "partitions the controller holds", value=len(st.partitions))
    shown = list(st.partitions)[-MAX_PARTITIONS:]
    samples = GaugeMetricFamily("dockd_partition_samples", "samples in a partition (the most recent "
                                f"{MAX_PARTITIONS} partitions)", labels=["partition"])
    taken = GaugeMetricFamily("dockd_consumer_taken_samples", "samples a consumer has taken for good",
                              labels=["partition", "consumer"])
    leased = GaugeMetricFamily("dockd_consumer_leased_samples", "samples a consumer holds under lease",
                               labels=["partition", "consumer"])
    ready = GaugeMetricFamily("dockd_consumer_ready_samples",
                              "samples a consumer could take now (for the columns it asked for)",
                              labels=["partition", "consumer"])
    deleted = GaugeMetricFamily("dockd_partition_deleted_samples", "samples of a partition deleted (by delete or "
                                "retirement; their data is freed)", labels=["partition"])
    version = GaugeMetricFamily("dockd_partition_policy_version", "the trainer's policy version (set_version)",
                                labels=["partition"])
    pending = GaugeMetricFamily("dockd_partition_pending_samples", "samples not yet handed out to all the partition's "
                                "consumers (what max_pending bounds)", labels=["partition"])
    stale = GaugeMetricFamily("dockd_partition_stale_samples", "samples staler than max_staleness allows, not yet "
                              "taken: no get hands them out", labels=["partition"])
    retired = GaugeMetricFamily("dockd_partition_stale_retired_samples", "samples deleted because set_version made "
                                "them stale (retire_stale)", labels=["partition"])
    paced = GaugeMetricFamily("dockd_paced_puts_waiting", "puts waiting for the partition's consumers (max_pending)",
                              labels=["partition"])
    for ps in shown:
        version.add_metric([ps.name], ps.version)
        pending.add_metric([ps.name], ps.pending)
        stale.add_metric([ps.name], ps.stale)
        retired.add_metric([ps.name], ps.stale_retired)
        paced.add_metric([ps.name], ps.paced)
        samples.add_metric([ps.name], ps.samples)
        deleted.add_metric([ps.name], ps.deleted)
        for cs in ps.consumers:
            taken.add_metric([ps.name, cs.name], cs.taken)
            leased.add_metric([ps.name, cs.name], cs.leased)
            ready.add_metric([ps.name, cs.name], cs.ready)
    yield from (samples, deleted, taken, leased, ready, version, pending, stale, retired, paced)
    yield CounterMetricFamily("dockd_paced_puts", "puts that waited for their partition's consumers (max_pending)",
                              value=ctl.paced_total)
    hist = HistogramMetricFamily("dockd_sample_staleness", "the trainer's policy version minus the version of each "
                                 "sample handed out (partitions with versions)")
    run, buckets = 0, []
    for bound, n in zip((*map(str, STALENESS_BUCKETS), "+Inf"), ctl.staleness_counts):
        run += n
        buckets.append((bound, run))
    hist.add_metric([], buckets, ctl.staleness_sum)
    yield hist


class MetricsServer:
    """A minimal HTTP endpoint for Prometheus on the daemon's event loop: GET /metrics."""

    MAX_REQUEST = 16 << 10
    TIMEOUT = 10.0

    def __init__(self, node: NodeFigures) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(node))
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True,
                                                limit=self.MAX_REQUEST)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port} (--metrics-port): {e.strerror or e}") from None
        server: Any = self._server  # (uvloop's .sockets is a list where typeshed says tuple: compiled, a check)
        self.port = server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.TIMEOUT)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
            path = path.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
            elif path in ("/metrics", "/"):
                t0 = time.perf_counter()
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.render()
                logger.debug("[metrics] scrape bytes=%d seconds=%.4f", len(body), time.perf_counter() - t0)
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"dockd serves its metrics at /metrics\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode() + (body if method != "HEAD" else b"")
            )
            await asyncio.wait_for(writer.drain(), self.TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass  # a client that hung up, sent garbage or too much: nothing to answer
        except Exception:  # a bug in a collector must not take the daemon down
            logger.exception("[metrics] scrape failed")
        finally:
            writer.close()
