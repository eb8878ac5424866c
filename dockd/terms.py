"""Terms the warehouse and the controller share beside the wire messages, so that neither package
imports the other: what a put's commit came to (`CommitOutcome`), and the instance bit of a warehouse
that comes back after a restart (`DURABLE`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dockd._proto import dockd_pb2 as pb

DURABLE = 1 << 62
"""Set in the instance of a warehouse with a data dir (--data-dir): it comes back after a restart, so its
controller waits out --warehouse-grace for it, and a value recorded on it that it no longer holds was never
acknowledged (unwritten again, not lost)."""


@dataclasses.dataclass(slots=True, frozen=True)
class CommitOutcome:
    """What a put's commit came to: the indexes its values go under, or why it failed.

    The controller makes one for every commit it applies (`indexes`, `stored`); the warehouse's committer
    adds what the put pipeline acts on besides (`replica`, `cleared`, `error`)."""

    indexes: np.ndarray | Sequence[int] = ()
    stored: bool = False
    """A re-sent put (its writer's token seen before) whose values a warehouse holds already: it is
    answered with the indexes and stored nowhere."""
    replica: pb.WarehouseInfo | None = None
    """--replicas 2: the warehouse the put is copied to before it is answered."""
    cleared: bool = False
    """Its partition was cleared after the commit was applied: the put is answered, and not stored."""
    error: BaseException | None = None
    """The commit failed (the put's answer)."""

    def listed(self) -> list[int]:
        """The indexes as a list of ints (a put's answer)."""
        return self.indexes.tolist() if isinstance(self.indexes, np.ndarray) else list(self.indexes)
