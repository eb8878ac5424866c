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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from dockd.errors import DockNotFound, DockValueError
from dockd.weights import versions as vt
from dockd.weights.buckets import Bucket, Packer
from dockd.weights.table import Table, now_ms

if TYPE_CHECKING:
    from dockd.client.dock import Dock

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


class Publication:
    """One version being published; see the module's docstring. Not thread-safe."""

    def __init__(self, dock: Dock, *, model: str = "default", version: int | None = None,
                 bucket_size: int = DEFAULT_BUCKET_SIZE, keep: int = DEFAULT_KEEP, hold: float = DEFAULT_HOLD_S,
                 timeout: float | None = None, dtype: torch.dtype | None = None, fanout: int = 1) -> None:
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
            raise DockValueError(f"fanout must be an int >= 1 (warehouses each relay holder sends to; 1: a chain), "
                                 f"got {fanout!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise DockValueError(f"keep must be an int >= 1 (versions kept), got {keep!r}")
        if not isinstance(hold, (int, float)) or not hold > 0:
            raise DockValueError(f"hold must be > 0 seconds, got {hold!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise DockValueError(f"dtype must be a torch.dtype (floating weights are cast to it) or None, got {dtype!r}")
        self.t0 = time.perf_counter()
        self.dock = dock
        self.table = Table(dock, model)
        self.keep, self.hold, self.timeout, self.dtype, self.fanout = keep, float(hold), timeout, dtype, fanout
        self.packer = Packer(bucket_size)
        known = self.table.versions()
        if version is None:
            version = known[-1].version + 1 if known else 0
        self.version = vt.check_version(version)
        if any(v.version == self.version for v in known):
            raise DockValueError(f"version {self.version} of model {model!r} is already published; publish a new one "
                                 f"(held: {', '.join(str(v.version) for v in known)})")
        self.partition = vt.version_partition(model, self.version)
        self.dock.create_partition(self.table.manifest)
        self.table.clear_abandoned(self.version)
        with contextlib.suppress(DockNotFound):  # (this version's own leftovers, from a publisher that died)
            self.dock.clear(self.partition)
        self.table.retire(keep=keep, hold_s=self.hold)  # (room for this one)
        self.samples: list[int] = []
        self.stored = 0
        self.finished: Published | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Pack one tensor; puts the buckets it completes."""
        if self.finished is not None:
            raise DockValueError("this version is finished; start a new Publication")
        if self.dtype is not None and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        for b in self.packer.add(name, tensor):
            self._put(b)

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)

    def _put(self, b: Bucket) -> None:
        idx, = self.dock.put({"data": [b.data]}, partition=self.partition, timeout=self.timeout)
        self.samples.append(idx)
        self.stored += int(b.data.numel())

    def record(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": self.table.model, "version": self.version,
                "buckets": len(self.samples), "samples": self.samples, "nbytes": self.packer.nbytes,
                "stored": self.stored, "pieces": [p.pack() for p in self.packer.pieces], "origin": self.dock.home,
                "keep": self.keep, "hold": self.hold, "fanout": self.fanout}

    def finish(self) -> Published:
        """Put the last bucket, then the manifest record (the version is visible from then on), then
        retire what the new version lets go."""
        if self.finished is not None:
            return self.finished
        last = self.packer.finish()
        if last is not None:
            self._put(last)
        self.dock.seal(self.partition)
        self.dock.put({"manifest": [self.record()]}, partition=self.table.manifest, timeout=self.timeout,
                      tags={vt.VERSION_TAG: self.version, vt.TIME_TAG: now_ms()})
        retired = self.table.retire(keep=self.keep, hold_s=self.hold)
        self.finished = Published(self.table.model, self.version, len(self.samples), len(self.packer.names),
                                  self.packer.nbytes, self.stored, time.perf_counter() - self.t0, retired)
        logger.info("[weights] published model=%s version=%d buckets=%d bytes=%d seconds=%.3f", self.table.model,
                    self.version, len(self.samples), self.stored, self.finished.seconds)
        return self.finished
