"""Publishing a version of a model's weights: buckets put to the publisher's warehouse, then the fence.

    pub = Publication(dock, model="policy", version=7, bucket_size=64 << 20)
    for name, tensor in model.state_dict().items():
        pub.add(name, tensor)           # puts the buckets this tensor completes
    pub.finish()                        # the last bucket, then the manifest record: visible from now

A version is visible to readers only once `finish` put its manifest record, after every bucket
was stored (the ready fence); a publisher that dies before leaves the previous versions as they
were, and the next publish clears what it left. One process publishes a given model at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dockd.errors import DockNotFound, DockTypeError, DockValueError
from dockd.weights import delta
from dockd.weights import versions as vt
from dockd.weights.buckets import Bucket, Packer
from dockd.weights.table import Table, now_ms

if TYPE_CHECKING:
    from dockd.client.interface import DockInterface as Dock

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_SIZE = 32 << 20
DEFAULT_KEEP = 2
DEFAULT_HOLD_S = 120.0
FORMAT = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Published:
    """What a publish stored."""

    model: str
    version: int
    buckets: int
    tensors: int
    nbytes: int          # tensor bytes
    stored: int          # bytes put (buckets)
    seconds: float
    retired: list[int]
    base: int | None = None  # a delta version: the version it is the difference to


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """How a model's versions are published (checked once)."""

    bucket_size: int = DEFAULT_BUCKET_SIZE
    keep: int = DEFAULT_KEEP          # versions kept
    hold: float = DEFAULT_HOLD_S      # seconds a reader that has not read a version holds it back
    timeout: float | None = None      # seconds a put may wait for room (None: as long as it takes)
    dtype: torch.dtype | None = None  # floating tensors are cast to it first
    fanout: int = 1                   # warehouses each holder relays a version to (1: a chain)

    def __post_init__(self) -> None:
        for name, low in (("fanout", 1), ("keep", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise DockValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not isinstance(self.hold, (int, float)) or not self.hold > 0:
            raise DockValueError(f"hold must be > 0 seconds, got {self.hold!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise DockValueError(f"dtype must be a torch.dtype (floating weights are cast to it) or None, "
                                 f"got {self.dtype!r}")


class Publication:
    """One version being published; see the module's docstring. Not thread-safe.

    `base=(version, tensors)`: publish it as a delta of that version, whose tensors (by name) are
    given (`dockd.weights.delta`); `snapshot`: keep a host copy of every tensor added (`snapshot`
    after `finish`), the base of a next delta version. Other keywords: `Settings`."""

    def __init__(self, dock: Dock, *, model: str = "default", version: int | None = None,
                 base: tuple[int, Mapping[str, torch.Tensor]] | None = None, snapshot: bool = False,
                 **settings: Any) -> None:
        self.settings = st = Settings(**settings)
        self.t0 = time.perf_counter()
        self.dock = dock
        self.table = Table(dock, model)
        self.packer = Packer(st.bucket_size)
        known = self.table.versions()
        if version is None:
            version = known[-1].version + 1 if known else 0
        self.version = vt.check_version(version)
        if any(v.version == self.version for v in known):
            raise DockValueError(f"version {self.version} of model {model!r} is already published; publish a new one "
                                 f"(held: {', '.join(str(v.version) for v in known)})")
        self.base_version: int | None = base[0] if base is not None else None
        self.base: Mapping[str, torch.Tensor] | None = base[1] if base is not None else None
        if self.base_version is not None and not any(v.version == self.base_version for v in known):
            self.base_version = self.base = None  # (its base was retired: this one goes whole)
        self.snapshot: dict[str, torch.Tensor] | None = {} if snapshot else None
        self.kinds: dict[str, str] = {}
        self.order: list[str] = []
        self.partition = vt.version_partition(model, self.version)
        self.dock.create_partition(self.table.manifest)
        self.table.clear_abandoned(self.version)
        with contextlib.suppress(DockNotFound):  # (this version's own leftovers, from a publisher that died)
            self.dock.clear(self.partition)
        self.table.retire(keep=st.keep, hold_s=st.hold)  # (room for this one)
        self.samples: list[int] = []
        self.stored = 0
        self.finished: Published | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Pack one tensor (as a delta of its base, if any); puts the buckets it completes."""
        if self.finished is not None:
            raise DockValueError("this version is finished; start a new Publication")
        if self.settings.dtype is not None and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            tensor = tensor.to(self.settings.dtype)
        if self.snapshot is not None and isinstance(tensor, torch.Tensor):
            self.snapshot[name] = tensor.detach().to("cpu", copy=True)
        if self.base is None:
            parts = [(name, tensor)]
        else:
            if not isinstance(tensor, torch.Tensor):
                raise DockTypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if name in self.kinds:
                raise DockValueError(f"weight {name!r} is given twice; names must be unique within a version")
            self.kinds[name], parts = delta.encode(name, tensor, self.base.get(name))
        self.order.append(name)
        for part, t in parts:
            for b in self.packer.add(part, t):
                self._put(b)

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)

    def _put(self, b: Bucket) -> None:
        idx, = self.dock.put({"data": [b.data]}, partition=self.partition, timeout=self.settings.timeout)
        self.samples.append(idx)
        self.stored += int(b.data.numel())

    def record(self) -> dict[str, Any]:
        st = self.settings
        rec = {"format": FORMAT, "model": self.table.model, "version": self.version,
               "buckets": len(self.samples), "samples": self.samples, "nbytes": self.packer.nbytes,
               "stored": self.stored, "pieces": [p.pack() for p in self.packer.pieces], "origin": self.dock.home,
               "keep": st.keep, "hold": st.hold, "fanout": st.fanout, "deltas": self.snapshot is not None}
        if self.base_version is not None:
            rec.update(base=self.base_version, kinds=self.kinds, order=self.order)
        return rec

    def finish(self) -> Published:
        """Put the last bucket, then the manifest record (the version is visible from then on), then
        retire what the new version lets go."""
        if self.finished is not None:
            return self.finished
        st = self.settings
        last = self.packer.finish()
        if last is not None:
            self._put(last)
        self.dock.seal(self.partition)
        base = -1 if self.base_version is None else self.base_version
        self.dock.put({"manifest": [self.record()]}, partition=self.table.manifest, timeout=st.timeout,
                      tags={vt.VERSION_TAG: self.version, vt.TIME_TAG: now_ms(), vt.BASE_TAG: base})
        retired = self.table.retire(keep=st.keep, hold_s=st.hold)
        self.finished = Published(self.table.model, self.version, len(self.samples), len(self.order),
                                  self.packer.nbytes, self.stored, time.perf_counter() - self.t0, retired,
                                  None if self.base_version is None else self.base_version)
        logger.info("[weights] published model=%s version=%d buckets=%d bytes=%d base=%s seconds=%.3f",
                    self.table.model, self.version, len(self.samples), self.stored, self.base_version,
                    self.finished.seconds)
        return self.finished


class Publisher:
    """Publishes the versions of one model. With `delta=True` each version is the difference to the one
    before (sparse where that is smaller; `dockd.weights.delta`), but every `full_every`-th, which goes
    whole (a reader rebuilds a delta version from its base): the publisher keeps a host copy of the
    last version for that. Other keywords: `Settings`."""

    def __init__(self, dock: Dock, model: str = "default", *, delta: bool = False, full_every: int = 16,
                 **settings: Any) -> None:
        if not isinstance(full_every, int) or isinstance(full_every, bool) or full_every < 1:
            raise DockValueError(f"full_every must be an int >= 1 (every n-th version goes whole), got {full_every!r}")
        self.dock, self.model, self.delta, self.full_every = dock, model, delta, full_every
        self.settings = Settings(**settings)
        self.last: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, its tensors) with delta
        self.since_full = 0

    def begin(self, version: int | None = None) -> Publication:
        base = self.last if self.delta and self.since_full % self.full_every else None
        return Publication(self.dock, model=self.model, version=version, base=base, snapshot=self.delta,
                           **dataclasses.asdict(self.settings))

    def finish(self, pub: Publication) -> Published:
        done = pub.finish()
        if pub.snapshot is not None:
            self.last = (pub.version, pub.snapshot)
            self.since_full = 1 if pub.base_version is None else self.since_full + 1
        return done

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> Published:
        pub = self.begin(version)
        pub.add_all(named)
        return self.finish(pub)
