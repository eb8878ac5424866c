"""Bounds on every request a daemon takes, checked before any memory is committed to it.

A frame's size is bounded by the framing (`wire.MAX_HEADER`, the put's admitted
capacity); this bounds what a small header can ask for: names, how many
columns, how many samples in one request. A request past a bound gets a clear
DockValueError and the connection keeps working. The bounds also keep every
reply within `wire.MAX_REPLY_HEADER`, so that a request is either refused here,
before anything is applied, or applied and answered.
"""

from __future__ import annotations

from collections.abc import Collection

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockValueError

MAX_NAME = 256            # characters in a partition, column, consumer or client name
MAX_COLUMNS = 64          # columns in one request (a partition holds at most 64)
MAX_SAMPLES = 1 << 22     # samples in one put, get, read or commit
MAX_TIMEOUT = 365 * 86400  # seconds a request may wait (longer: none at all, -1)
MAX_CELLS = 1 << 23       # samples x columns in one get, fetch or locate (what its reply lists)
MAX_LEASES = 1 << 16      # leases in one confirm
MAX_OPEN_LEASES = 1 << 20 # leases outstanding in a dock (~0.5 KiB of controller memory each)
MAX_PARTITIONS = 1 << 16  # partitions of a dock (and so in one warehouse's inventory)
MAX_CONSUMERS = 1024      # consumer names of one partition
MAX_DOCK_SAMPLES = 1 << 27  # samples of a dock's partitions together (default; the controller holds ~24 B each)
MAX_PARKED = 1024         # gets of one connection waiting for data at once
MAX_PARKED_DOCK = 1 << 16 # ... of all connections
MAX_TAGS = 16             # tags in one request (a partition holds at most 16)
MAX_RANKS = 1 << 16       # data-parallel ranks of one rank-aware get
MAX_COMMIT_BATCH = 256    # commits a warehouse coalesces into one message to its controller
MAX_LINKS = 256           # device links one warehouse keeps open (cross-node device reads)
LINK_ID_BYTES = 16
MAX_RENDEZVOUS = 4108     # bytes of a device link's rendezvous (HcclRootInfo, the largest)


def _name(what: str, value: str) -> None:
    if len(value) > MAX_NAME:
        raise DockValueError(f"{what} of {len(value)} characters is too long (at most {MAX_NAME})")


def _count(what: str, n: int, limit: int = MAX_SAMPLES) -> None:
    if n > limit:
        raise DockValueError(f"{n} {what} in one request is too many (at most {limit}); split it")


def _columns(names: Collection[str]) -> None:
    _count("columns", len(names), MAX_COLUMNS)
    for c in names[:]:  # type: ignore[index]  # (a repeated field or a list: see dockd.net.wire)
        _name("column name", c)


def _tags(tags: Collection[pb.Tag]) -> None:
    _count("tags", len(tags), MAX_TAGS)
    for t in tags[:]:  # type: ignore[index]  # (a repeated field or a list: see dockd.net.wire)
        _name("tag name", t.name)
        _count("tag values", len(t.values))


def _timeout(value: float) -> None:
    if not (value == -1 or 0 <= value <= MAX_TIMEOUT):  # (NaN fails both)
        raise DockValueError(f"a timeout of {value} seconds: give 0..{MAX_TIMEOUT:g}, or -1 for none")


def _commit(r: pb.CommitRequest) -> None:
    _name("partition name", r.partition)
    _columns(r.columns)
    _count("samples", max(r.new_count, len(r.indexes), r.group_size))
    _tags(r.tags)


def check(frame: pb.Frame) -> None:
    """Raise DockValueError if a request asks for more than a daemon gives one request."""
    kind = frame.WhichOneof("kind")
    if kind == "put":
        r = frame.put
        _timeout(r.timeout)
        _name("partition name", r.partition)
        _columns([c.name for c in r.columns[:]])
        _count("samples", max(r.new_count, len(r.indexes), r.group_size))
        _tags(r.tags)
        _count("device buffers", len(r.device_buffers), MAX_COLUMNS)
    elif kind == "acquire":
        r = frame.acquire
        _timeout(r.timeout)
        _name("partition name", r.partition)
        _name("consumer name", r.consumer)
        _columns(r.columns)
        _count("samples", r.count)
        _count("confirms", len(r.confirm), MAX_LEASES)
        _count("data-parallel ranks", r.dp_size, MAX_RANKS)
        _count("samples", r.count * max(r.dp_size, 1))
        if not r.allow_partial:  # (a partial get takes at most what one reply holds: see the controller service)
            _count("sample-columns (samples x columns)", r.count * max(r.dp_size, 1) * max(len(r.columns), 1),
                   MAX_CELLS)
        _columns(r.balance_by)
        _name("order_by", r.order_by)
        _count("tag filters", len(r.where), MAX_TAGS)
        for t in r.where[:]:
            _name("tag name", t.name)
    elif kind == "fetch":
        _name("partition name", frame.fetch.partition)
        columns = frame.fetch.columns[:]
        _columns([c.name for c in columns])
        for c in columns:
            _count("samples", len(c.indexes))
        _count("sample-columns (samples x columns)", sum(len(c.indexes) for c in columns), MAX_CELLS)
        if frame.fetch.HasField("link"):
            link = frame.fetch.link
            if len(link.id) != LINK_ID_BYTES:
                raise DockValueError(f"a device link id is {LINK_ID_BYTES} bytes, got {len(link.id)}")
            if len(link.rendezvous) > MAX_RENDEZVOUS:
                raise DockValueError(f"a device link rendezvous of {len(link.rendezvous)} bytes is too long "
                                     f"(at most {MAX_RENDEZVOUS})")
            _name("device link backend", link.backend)
    elif kind == "locate":
        _name("partition name", frame.locate.partition)
        _columns(frame.locate.columns)
        _count("samples", len(frame.locate.indexes))
        _count("sample-columns (samples x columns)", len(frame.locate.indexes) * max(len(frame.locate.columns), 1),
               MAX_CELLS)
    elif kind == "confirm":
        _count("confirms", max(len(frame.confirm.leases), len(frame.confirm.tickets)), MAX_LEASES)
    elif kind == "clear":
        _name("partition name", frame.clear.partition)
    elif kind == "commit":
        _commit(frame.commit)
    elif kind == "commits":
        _count("commits in a batch", len(frame.commits.commits), MAX_COMMIT_BATCH)
        for r in frame.commits.commits:
            _commit(r)
    elif kind == "partition":
        r = frame.partition
        _name("partition name", r.partition)
        _count("samples", max(len(r.delete.indexes), r.reserve.count, r.reserve.group_size, len(r.set_tags.indexes)))
        _tags(r.set_tags.tags)
        _columns(r.create.retire_when_consumed_by)
        _name("consumer name", r.list.consumer)
        _name("consumer name", r.drop_consumer.consumer)
        _count("tag filters", len(r.list.where), MAX_TAGS)
        for t in r.list.where:
            _name("tag name", t.name)
    elif kind in ("free", "measure", "replicate"):
        m = getattr(frame, kind)
        _name("partition name", m.partition)
        _count("samples", len(m.indexes))
        if kind == "replicate":
            _columns(m.columns)
    elif kind == "register":
        _count("partitions", len(frame.register.inventory), MAX_PARTITIONS)
        _count("pending commits", len(frame.register.pending), MAX_PARTITIONS)
    elif kind == "hello":
        _name("client name", frame.hello.client)
