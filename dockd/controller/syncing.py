"""The journal's batched durability on the service's timers: what was written is fsynced in a
worker thread within `fsync_interval` seconds, and a snapshot replaces the journal when it grew
past its size or stopped taking records (see `dockd.controller.journal`).

The timer runs only while there is something to do: the first record written after a sync, or
the journal stopping, arms it (`Journal.on_due`), and it goes on while records are unsynced, an
fsync is under way or a snapshot is due. An idle controller is not woken for its journal (it was,
every `fsync_interval`: 20 wake-ups a second)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from dockd.controller.clock import Timer, Timers
from dockd.controller.core import Controller
from dockd.controller.journal import Journal

logger = logging.getLogger(__name__)


class Syncing:
    """Syncs and compacts `journal` on `timers`. `snapshot` gives what a compaction writes (the
    controller and the warehouses' records, read when it runs); `resumed` is called when a snapshot
    let a journal that had stopped take records again."""

    def __init__(self, journal: Journal, timers: Timers, *,
                 snapshot: Callable[[], tuple[Controller, Mapping[int, dict]]], resumed: Callable[[], None]) -> None:
        self.journal = journal
        self.timers = timers
        self.snapshot = snapshot
        self.resumed = resumed
        self._timer: Timer | None = None
        self._syncing = False  # an fsync runs in a worker thread
        journal.on_due = self.arm

    def arm(self) -> None:
        """Sync within fsync_interval (the timer is set unless it already is)."""
        if self._timer is None:
            self._timer = self.timers.call_later(self.journal.fsync_interval, self._tick)

    def _tick(self) -> None:
        self._timer = None
        j = self.journal
        try:
            now = self.timers.clock()
            if j.compaction_due(now) and not self._syncing:  # (never under an fsync of the old file)
                broken = j.broken is not None
                core, warehouses = self.snapshot()
                if j.compact(core, warehouses, now=now) and broken:
                    self.resumed()  # the journal takes records again: retry the gets that waited meanwhile
            elif j.dirty and not self._syncing:
                self._syncing = True
                asyncio.get_running_loop().run_in_executor(None, j.sync).add_done_callback(self._synced)
        finally:
            if j.dirty or self._syncing or j.broken is not None or j.needs_compaction():
                self.arm()

    def _synced(self, fut: asyncio.Future) -> None:
        self._syncing = False
        if fut.exception() is not None:
            logger.error("[journal] fsync failed: %s", fut.exception())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
