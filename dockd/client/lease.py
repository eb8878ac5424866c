"""`Lease`: samples acquired for a consumer but not fetched yet, as `Dock.acquire` hands them out."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(slots=True)
class Lease:
    """Samples acquired for a consumer but not fetched yet (low-level API).

    A lease belongs to the client that took it. To let another process confirm,
    release or extend it, hand it the lease with its `ticket` (it pickles); anyone
    may fetch its samples."""

    id: int
    partition: str
    columns: list[str]
    indexes: list[int]
    locations: np.ndarray | None  # warehouse id per (column, sample); None when every column came inline
    inline: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # columns that came with the acquire
    ticket: bytes = b""  # the hand-over proof (see the class docstring)
    step: int = 0        # rank-aware gets: the step this share belongs to
    rank_weights: list[float] = dataclasses.field(default_factory=list)  # ... each rank's sum of balance_by
    controller: str = ""  # several controllers: the address of the one that granted it ("": the first contact)
    # an acquire with per_lease (prefetch): every lease its samples went in, in order (this one the first)
    parts: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # seconds it had left when granted (0: not said)
    per: int = 0  # with `parts`: the samples in each but the last (0: not said)
