"""Reading versions of a model's weights: (name, tensor) of a complete version, as its buckets arrive.

    reader = WeightsReader(dock, model="policy")      # registers: it holds versions back from now on
    for name, tensor in reader.read():                # the newest complete version
        engine.load(name, tensor)
    for name, tensor in reader.read(after=reader.last, timeout=600):   # waits for the next one
        ...
    reader.close()

A reader only ever sees complete versions (see `versions`). Finishing a version marks it taken,
which lets versions up to it go once they are not among the newest `keep`; a reader that stops
part way holds the version back for at most the publisher's `hold` seconds after it was published.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dockd.errors import DockNotFound, DockValueError
from dockd.weights import delta, slices
from dockd.weights import versions as vt
from dockd.weights.buckets import Piece, Unpacker
from dockd.weights.slices import Layout, Slice
from dockd.weights.source import RelaySource
from dockd.weights.table import Table

if TYPE_CHECKING:
    from dockd.client.interface import DockInterface as Dock

logger = logging.getLogger(__name__)


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class WeightsReader:
    """A registered reader of one model's versions (see the module's docstring).

    Args:
        dock: the client.
        model: the model's name (as published).
        name: this reader's name in the version table (default: host, pid and a random suffix).
        relay: read through this client's own warehouse, which holds each version once (relayed from
            where it was published, or from a warehouse that holds it already); False: read each
            bucket from wherever the controller says it is (the publisher's warehouse).
    """

    def __init__(self, dock: Dock, model: str = "default", *, name: str | None = None, relay: bool = True) -> None:
        self.dock = dock
        self.relay = relay
        self.table = Table(dock, model)
        self.name = name or default_name()
        self.index = self.table.register(self.name)
        self.last: int | None = None  # the version last read to its end
        self.last_read: dict[str, Any] = {}  # figures of the last read: version, buckets, bytes, seconds
        self.kept: tuple[int, dict[str, torch.Tensor]] | None = None  # a model with deltas: the last version read

    def base(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of `version` whole (the base of a delta version): the last version read, or read now."""
        if self.kept is not None and self.kept[0] == version:
            return self.kept[1]
        got = {name: _owned(t) for name, t in self.open(version).tensors()}
        self.kept = (version, got)
        return got

    @property
    def model(self) -> str:
        return self.table.model

    def versions(self) -> list[int]:
        """The complete versions in the dock, oldest first."""
        return [v.version for v in self.table.versions()]

    def latest(self) -> int | None:
        """The newest complete version (None: none yet)."""
        v = vt.newest(self.table.versions())
        return v.version if v is not None else None

    def resolve(self, version: int | None = None, *, after: int | None = None,
                timeout: float | None = None) -> vt.Version:
        """The version a read of these arguments reads, waiting for it to be published if need be."""
        if version is not None and after is not None:
            raise DockValueError("give version= (that one) or after= (the newest one newer than it), not both")
        if version is not None:
            vt.check_version(version)
            v = self.table.wait(version, timeout)
            if v.version != version:
                return self.table.find(version)  # (a newer one is there: this one was retired, or skipped)
            return v
        if after is not None:
            return self.table.wait(vt.check_version(after, "after") + 1, timeout)
        found = vt.newest(self.table.versions())
        return found if found is not None else self.table.wait(0, timeout)

    def read(self, version: int | None = None, *, after: int | None = None, timeout: float | None = None,
             tp: tuple[int, int] | None = None, layout: Layout | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of one complete version, in the order they were published, as its buckets
        arrive: `version` (waiting for it to be published, up to `timeout` seconds), or the newest
        newer than `after` (waiting for one), or the newest now (waiting for a first one). The
        tensors are views of what was read (private copy-on-write mappings where the bytes came by
        shared memory): writing to them never changes the dock's copy.

        `tp=(rank, size)` with `layout` (per name a `dockd.resharding.ParamSpec`, or a function of
        (name, shape) giving one or None): each tensor the layout splits comes as the slice of
        tensor-parallel rank `rank` of `size` (the others whole), and only those bytes are read
        from the warehouse (`dockd.weights.slices`)."""
        reading = self.open(version, after=after, timeout=timeout)
        if tp is None:
            return reading.tensors()
        rank, size = tp
        return reading.sliced(layout, size, rank)

    def open(self, version: int | None = None, *, after: int | None = None,
             timeout: float | None = None) -> Reading:
        """The version `read` would read, to be read bucket by bucket (`Reading.buckets`, then
        `Reading.tensors_of` on each; `Reading.tensors` does both)."""
        v = self.resolve(version, after=after, timeout=timeout)
        return Reading(self, v, self.table.record(v))

    def _taken(self, version: int, rec: dict[str, Any]) -> None:
        if self.last is not None and version <= self.last:
            return  # (a base read again to rebuild a delta: nothing new is passed)
        try:
            self.table.taken(self.index, version)
        except DockNotFound:  # (dropped from the table as long gone: register again)
            self.index = self.table.register(self.name)
            self.table.taken(self.index, version)
        self.last = version
        self.table.retire(keep=int(rec["keep"]), hold_s=float(rec["hold"]))

    def close(self) -> None:
        """Leave the version table: this reader holds nothing back any more."""
        self.table.deregister(self.index)

    def __enter__(self) -> WeightsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Reading:
    """One version being read: `buckets()` yields (bucket, bytes) as they arrive, `tensors_of` turns
    each into (name, tensor); the version counts as taken once every tensor came out."""

    def __init__(self, reader: WeightsReader, v: vt.Version, record: dict[str, Any]) -> None:
        self.reader = reader
        self.version = v.version
        self.record = record
        self.partition = vt.version_partition(reader.model, v.version)
        self.unpacker = Unpacker([Piece.unpack(row) for row in record["pieces"]], int(record["buckets"]))
        self.bytes = 0
        self.t0 = time.perf_counter()
        self._finished = False
        self._source: RelaySource | None = None
        self.rebuild: delta.Rebuilder | None = None
        if "base" in record:
            self.rebuild = delta.Rebuilder(list(record["order"]), dict(record["kinds"]), reader.base(int(record["base"])))
        self._keep: dict[str, torch.Tensor] | None = {} if record.get("deltas") else None

    def source(self) -> RelaySource:
        """This version as held by the reader's own warehouse (made on first use)."""
        if self._source is None:
            rec = self.record
            self._source = RelaySource(self.reader.dock, self.partition, [int(s) for s in rec["samples"]],
                                       int(rec["origin"]), fanout=int(rec.get("fanout", 1)))
        return self._source

    def buckets(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Each bucket of the version: (its number, its bytes, a flat uint8 tensor)."""
        for b, sample in enumerate(self.record["samples"]):
            try:
                if self.reader.relay:
                    data = self.source().bucket(b)
                else:
                    data = self.reader.dock.read(self.partition, [int(sample)], ["data"])["data"][0]
            except DockNotFound:
                raise self._retired() from None
            self.bytes += int(data.numel())
            yield b, data

    def tensors_of(self, bucket: int, data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        out = self.unpacker.feed(bucket, data)
        if self.rebuild is not None:  # a delta version: its tensors rebuilt from the base's and the parts
            out = (x for part, t in out for x in self.rebuild.feed(part, t))
        keep = self._keep
        for name, t in out:
            if keep is not None:
                keep[name] = _owned(t)
            yield name, t
        if self.unpacker.done and (self.rebuild is None or self.rebuild.done):
            self._done()

    def _done(self) -> None:
        """Every tensor came out: the version is taken."""
        if self._finished:
            return
        self._finished = True
        r = self.reader
        r.last_read = {"version": self.version, "buckets": int(self.record["buckets"]), "bytes": self.bytes,
                       "seconds": time.perf_counter() - self.t0, "base": self.record.get("base")}
        if self._keep is not None:
            r.kept = (self.version, self._keep)
        r._taken(self.version, self.record)

    def sliced(self, layout: Layout | None, tp_size: int, tp_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as tensor-parallel rank `tp_rank` of `tp_size` holds them (see
        `WeightsReader.read`): only its slices' bytes are read, from the reader's own warehouse."""
        if self.rebuild is not None:  # (a delta version is rebuilt whole, then cut here)
            return self._cut(layout, tp_size, tp_rank)
        if not self.reader.relay:
            raise DockValueError("slices are read from the reader's own warehouse: use a reader with relay=True")
        todo: dict[int, list[Slice]] = {}
        for sl in slices.plan(self.unpacker.pieces, layout, tp_size, tp_rank):
            todo.setdefault(sl.last_bucket, []).append(sl)
        return self._sliced(todo)

    def _sliced(self, todo: dict[int, list[Slice]]) -> Iterator[tuple[str, torch.Tensor]]:
        src = self.source()
        samples = [int(x) for x in self.record["samples"]]
        for b in range(len(samples)):
            group = todo.get(b)
            if not group:
                continue
            try:
                src.wait(b)
                rs = [r for sl in group for r in sl.ranges]
                body = src.ranges([samples[r.bucket] for r in rs], [r.offset for r in rs], [r.length for r in rs],
                                  [r.count for r in rs], [r.stride for r in rs])
            except DockNotFound:
                raise self._retired() from None
            self.bytes += len(body)
            data = torch.from_numpy(body) if len(body) else torch.empty(0, dtype=torch.uint8)
            at = 0
            for sl in group:
                t, at = slices.assemble(sl, data, at)
                yield sl.name, t
        self._done()

    def _cut(self, layout: Layout | None, tp_size: int, tp_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.tensors():
            yield name, slices.reference(t, slices.spec_of(layout, name, tuple(t.shape)), tp_size, tp_rank)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for b, data in self.buckets():
            yield from self.tensors_of(b, data)
        if not self._finished:
            raise DockValueError(f"version {self.version} of model {self.reader.model!r} ended before all its "
                                 "tensors came")

    def _retired(self) -> DockNotFound:
        return DockNotFound(f"version {self.version} of model {self.reader.model!r} was retired while it was read "
                            f"(this reader did not finish it within the publisher's hold of "
                            f"{self.record['hold']:g}s after it was published); read the newest")


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it views memory of another tensor (a bucket read): kept past its read."""
    return t.clone() if t._base is not None else t
