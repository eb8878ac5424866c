"""A model's version table in the dock: the manifest and the readers partitions (see `versions`),
read and changed through the ordinary client calls (list, read, put, set_tags, acquire, clear)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from dockd.errors import DockNotFound, DockTimeout
from dockd.weights import versions as vt

if TYPE_CHECKING:
    from dockd.client.interface import DockInterface as Dock

logger = logging.getLogger(__name__)

LIST_LIMIT = 100_000  # (a model keeps a handful of versions; readers are at most a few thousand)
WAIT_LEASE_S = 10.0  # a waiting reader's lease on the version it waited for, given back at once


def now_ms() -> int:
    return int(time.time() * 1000)


class Table:
    def __init__(self, dock: Dock, model: str) -> None:
        self.dock = dock
        self.model = vt.check_model(model)
        self.manifest = vt.manifest_partition(model)
        self.readers_part = vt.readers_partition(model)

    # -- versions --------------------------------------------------------------------------------
    def versions(self) -> list[vt.Version]:
        """The complete versions, oldest first ([] before the first publish)."""
        try:
            return vt.versions_of(self.dock.list(self.manifest, limit=LIST_LIMIT))
        except DockNotFound:
            return []

    def record(self, v: vt.Version) -> dict[str, Any]:
        """The manifest record of a complete version (its index and settings)."""
        rec = self.dock.read(self.manifest, [v.index], ["manifest"])["manifest"][0]
        if not isinstance(rec, dict) or rec.get("version") != v.version:
            raise DockNotFound(f"the manifest of model {self.model!r} has no readable record of version {v.version}")
        return rec

    def find(self, version: int) -> vt.Version:
        for v in self.versions():
            if v.version == version:
                return v
        raise DockNotFound(f"version {version} of model {self.model!r} is not in the dock (not published yet, or "
                           "retired); versions held: " + (", ".join(str(v.version) for v in self.versions()) or "none"))

    def wait(self, at_least: int, timeout: float | None) -> vt.Version:
        """The newest complete version >= `at_least`, waiting for one to be published (DockTimeout after
        `timeout` seconds; None: as long as it takes)."""
        found = vt.newest(self.versions(), at_least)
        if found is not None:
            return found
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:  # (leased and given back: the manifest sample stays for everyone)
                lease = self.dock.acquire(vt.WAIT_CONSUMER, ["manifest"], 1, partition=self.manifest, timeout=left,
                                          where={vt.VERSION_TAG: (at_least, vt.MAX_VERSION)}, inline=False,
                                          lease_timeout=WAIT_LEASE_S)
            except DockTimeout:
                raise DockTimeout(f"no version >= {at_least} of model {self.model!r} was published within "
                                  f"{timeout:g}s") from None
            self.dock.release(lease)
            found = vt.newest(self.versions(), at_least)
            if found is not None:
                return found  # (else retired between the wake-up and the listing: wait again)

    # -- readers ---------------------------------------------------------------------------------
    def register(self, name: str) -> int:
        """Add a reader to the table (it holds versions back from now on); its sample index."""
        idx, = self.dock.put({"reader": [name]}, partition=self.readers_part,
                             tags={vt.TAKEN_TAG: -1, vt.SEEN_TAG: now_ms()})
        return idx

    def taken(self, index: int, version: int) -> None:
        """A reader finished reading `version`: it no longer holds back versions up to it."""
        self.dock.set_tags(self.readers_part, [index], {vt.TAKEN_TAG: version, vt.SEEN_TAG: now_ms()})

    def deregister(self, index: int) -> None:
        with contextlib.suppress(DockNotFound):
            self.dock.delete(self.readers_part, [index])

    def readers(self) -> list[vt.Reader]:
        try:
            return vt.readers_of(self.dock.list(self.readers_part, limit=LIST_LIMIT))
        except DockNotFound:
            return []

    # -- retiring --------------------------------------------------------------------------------
    def retire(self, *, keep: int, hold_s: float) -> list[int]:
        """Clear the versions `versions.retirable` gives up, and forget readers long gone; the versions
        retired. Safe to run from several processes at once (a version cleared twice is cleared once)."""
        now = now_ms()
        hold_ms = int(hold_s * 1000)
        versions, readers = self.versions(), self.readers()
        gone = vt.retirable(versions, readers, keep=keep, hold_ms=hold_ms, now_ms=now)
        for v in gone:
            with contextlib.suppress(DockNotFound):
                self.dock.delete(self.manifest, [v.index])  # (first: no reader finds it from now on)
            with contextlib.suppress(DockNotFound):
                self.dock.clear(vt.version_partition(self.model, v.version))
        stale = vt.stale_readers(readers, hold_ms=hold_ms, now_ms=now)
        if stale:
            with contextlib.suppress(DockNotFound):
                self.dock.delete(self.readers_part, [r.index for r in stale])
        if gone:
            logger.info("[weights] retired model=%s versions=%s kept=%s", self.model, [v.version for v in gone],
                        [v.version for v in versions if v not in gone])
        return [v.version for v in gone]

    def clear_abandoned(self, publishing: int) -> list[str]:
        """Clear version partitions no manifest record fences (a publish that died), but `publishing`."""
        names = list(self.dock.stats()["partitions"])
        done = [v.version for v in self.versions()]
        out = vt.abandoned(self.model, names, done, publishing)
        for p in out:
            with contextlib.suppress(DockNotFound):
                self.dock.clear(p)
        if out:
            logger.warning("[weights] cleared %d unfinished versions of model=%s (a publish that did not finish): %s",
                           len(out), self.model, out)
        return out
