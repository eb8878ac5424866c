"""Dropping blocks of indexes (`blocks`): journaled, their unwritten samples deleted, logged. Shared by
the block service (a seal's handshake, a rejoin) and membership (an owner that leaves, restarts or is lost)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dockd.controller.core import Controller
from dockd.controller.journal import Journal

logger = logging.getLogger(__name__)


def drop_blocks(core: Controller, journal: Journal | None, ids: Iterable[int], why: str, *,
                quiet: bool = False) -> set[str]:
    """Drop blocks (journaled; their unwritten samples deleted); returns their partitions, whose waiting
    gets may end now. `quiet`: a routine drop (blocks written in full, or moved past by their owner), logged at
    debug level, and journaled with the next record when it deletes nothing."""
    dropped, deleted = core.drop_blocks(list(ids))
    if not dropped:
        return set()
    if journal is not None:
        journal.blocks_dropped([b.id for b in dropped], hold=quiet and not deleted)
    logger.log(logging.DEBUG if quiet else logging.INFO,
               "[controller] blocks dropped blocks=%s samples_deleted=%d reason=%r", [b.id for b in dropped], deleted,
               why)
    return {b.partition for b in dropped}
