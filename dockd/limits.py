"""Bounds on every request a daemon takes, checked before any memory is committed to it.

A frame's size is bounded by the framing (`wire.MAX_HEADER`, the put's admitted
capacity); this bounds what a small header can ask for: names, how many
columns, how many samples in one request. A request past a bound gets a clear
DockValueError and the connection keeps working. The bounds also keep every
reply within `wire.MAX_REPLY_HEADER`, so that a request is either refused here,
before anything is applied, or applied and answered.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

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


def _put(r: pb.PutRequest) -> None:
    _timeout(r.timeout)
    _name("partition name", r.partition)
    _columns([c.name for c in r.columns[:]])
    _count("samples", max(r.new_count, len(r.indexes), r.group_size))
    _tags(r.tags)
    _count("device buffers", len(r.device_buffers), MAX_COLUMNS)


class Acquire:
    """An acquire's fields, each read once (every read of a message's field is a call into protobuf), as plain
    values for the controller's get path to pass down; `r`: the request itself (its rarely set fields, and
    where it is written: a partial get's count)."""

    def __init__(self, r: pb.AcquireRequest) -> None:
        self.r = r
        self.partition: str = r.partition
        self.consumer: str = r.consumer
        self.columns: list[str] = r.columns[:]
        self.count: int = r.count
        self.timeout: float = r.timeout
        self.dp_size: int = r.dp_size
        self.per_lease: int = r.per_lease
        self.allow_partial: bool = r.allow_partial
        self.groups: bool = r.groups
        self.confirms: list[int] = r.confirm[:]
        self.token: int = r.token
        self.inline: bool = r.inline
        self.device: bool = r.device
        self.shuffle: bool = r.shuffle
        self.near: int = r.near
        self.max_staleness: int = r.max_staleness
        self.lease_seconds: float = r.lease_seconds
        self.order_by: str = r.order_by
        self.where: list[pb.TagRange] = r.where[:]


def acquire(r: pb.AcquireRequest) -> Acquire:
    """An acquire's fields (read once), or DockValueError if it asks for more than a daemon gives one request."""
    a = Acquire(r)
    _acquire(a)
    return a


def _acquire(a: Acquire) -> None:
    # (every get comes here: the bounds compared in place, and the checks above called in their order
    # only when one is passed, to say which)
    count, ranks, per_lease, columns, timeout = a.count, a.dp_size, a.per_lease, a.columns, a.timeout
    if not (timeout == -1 or 0 <= timeout <= MAX_TIMEOUT):
        _timeout(timeout)
    partition, consumer = a.partition, a.consumer
    if len(partition) > MAX_NAME or len(consumer) > MAX_NAME:
        _name("partition name", partition)
        _name("consumer name", consumer)
    if len(columns) > MAX_COLUMNS:
        _columns(columns)
    for c in columns:
        if len(c) > MAX_NAME:
            _columns(columns)
    confirms = len(a.confirms)
    leases = -(-count // per_lease) if per_lease else 0
    samples = count * max(ranks, 1)
    # (a partial get takes at most what one reply holds: see the controller service)
    cells = 0 if a.allow_partial else samples * max(len(columns), 1)
    if count > MAX_SAMPLES or confirms > MAX_LEASES or leases > MAX_LEASES or ranks > MAX_RANKS \
            or samples > MAX_SAMPLES or cells > MAX_CELLS:
        _count("samples", count)
        _count("confirms", confirms, MAX_LEASES)
        _count("leases (count / per_lease)", leases, MAX_LEASES)
        _count("data-parallel ranks", ranks, MAX_RANKS)
        _count("samples", samples)
        _count("sample-columns (samples x columns)", cells, MAX_CELLS)
    balance_by = a.r.balance_by[:]
    if balance_by:
        _columns(balance_by)
    if a.order_by:
        _name("order_by", a.order_by)
    where = a.where
    if where:
        _count("tag filters", len(where), MAX_TAGS)
        for t in where:
            _name("tag name", t.name)


def _fetch(r: pb.FetchRequest) -> None:
    _name("partition name", r.partition)
    columns = r.columns[:]
    _columns([c.name for c in columns])
    for c in columns:
        _count("samples", len(c.indexes))
    _count("sample-columns (samples x columns)", sum(len(c.indexes) for c in columns), MAX_CELLS)
    if r.HasField("link"):
        link = r.link
        if len(link.id) != LINK_ID_BYTES:
            raise DockValueError(f"a device link id is {LINK_ID_BYTES} bytes, got {len(link.id)}")
        if len(link.rendezvous) > MAX_RENDEZVOUS:
            raise DockValueError(f"a device link rendezvous of {len(link.rendezvous)} bytes is too long "
                                 f"(at most {MAX_RENDEZVOUS})")
        _name("device link backend", link.backend)


def _locate(r: pb.LocateRequest) -> None:
    _name("partition name", r.partition)
    _columns(r.columns)
    _count("samples", len(r.indexes))
    _count("sample-columns (samples x columns)", len(r.indexes) * max(len(r.columns), 1), MAX_CELLS)


def _confirm(r: pb.ConfirmRequest) -> None:
    _count("confirms", max(len(r.leases), len(r.tickets)), MAX_LEASES)


def _release(r: pb.ReleaseRequest) -> None:
    _count("leases", len(r.leases), MAX_LEASES)


def _clear(r: pb.ClearRequest) -> None:
    _name("partition name", r.partition)


def _commits(r: pb.CommitBatch) -> None:
    commits = r.commits
    _count("commits in a batch", len(commits), MAX_COMMIT_BATCH)
    last: tuple[str, list[str]] | None = None
    for c in commits:  # (the names of consecutive commits to one partition's same columns are checked once)
        names = (c.partition, c.columns[:])
        if names != last or c.tags:
            _commit(c)
            last = names
        else:
            _count("samples", max(c.new_count, len(c.indexes), c.group_size))


def _partition(r: pb.PartitionRequest) -> None:
    _name("partition name", r.partition)
    _count("samples", max(len(r.delete.indexes), r.reserve.count, r.reserve.group_size, len(r.set_tags.indexes)))
    _tags(r.set_tags.tags)
    _columns(r.create.retire_when_consumed_by)
    _name("consumer name", r.list.consumer)
    _name("consumer name", r.drop_consumer.consumer)
    _count("tag filters", len(r.list.where), MAX_TAGS)
    for t in r.list.where:
        _name("tag name", t.name)


def _samples_of(r: pb.FreeRequest | pb.MeasureRequest) -> None:
    _name("partition name", r.partition)
    _count("samples", len(r.indexes))


def _replicate(r: pb.ReplicateRequest) -> None:
    _samples_of(r)
    _columns(r.columns)


def _register(r: pb.RegisterWarehouse) -> None:
    _count("partitions", len(r.inventory), MAX_PARTITIONS)
    _count("pending commits", len(r.pending), MAX_PARTITIONS)


def _hello(r: pb.Hello) -> None:
    _name("client name", r.client)


_CHECKS: dict[str, Callable[[Any], None]] = {
    "put": _put, "acquire": lambda r: _acquire(Acquire(r)), "fetch": _fetch, "locate": _locate, "confirm": _confirm, "release": _release,
    "clear": _clear,
    "commit": _commit, "commits": _commits, "partition": _partition, "free": _samples_of, "measure": _samples_of,
    "replicate": _replicate, "register": _register, "hello": _hello,
}
"""The bounds of each kind of request (the frame's `kind`) that has any."""


def check(frame: pb.Frame, kind: str | None = None) -> None:
    """Raise DockValueError if a request asks for more than a daemon gives one request. `kind`: the
    frame's kind, where the caller has it (else it is read from the frame)."""
    if kind is None:
        kind = frame.WhichOneof("kind")
    checks = _CHECKS.get(kind)
    if checks is not None:
        checks(getattr(frame, kind))
