"""What a get or an acquire asks for: `GetOptions`, made once per call from the arguments of
`Dock.get` or `Dock.acquire`, and the acquire frame it becomes (`frame`: every argument is
checked there, before anything is sent)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from dockd import ids, limits
from dockd._proto import dockd_pb2 as pb
from dockd.client import validate
from dockd.errors import DockValueError


@dataclasses.dataclass(slots=True, kw_only=True)
class GetOptions:
    """The arguments of one `Dock.get` or `Dock.acquire`, as given (see those for what each does).

    Read-only (`Final`: mypy refuses a write) rather than frozen=True, which would cost an
    object.__setattr__ per field on every get: 2.6 us to make one instead of 0.9 us."""

    consumer: Final[str]
    columns: Final[Sequence[str]]
    count: Final[int]
    partition: Final[str]
    timeout: Final[float | None]
    groups: Final[bool]
    allow_partial: Final[bool]
    shuffle: Final[bool]
    seed: Final[int | None]
    dp_rank: Final[int | None]
    dp_size: Final[int | None]
    mp_group: Final[tuple[int, int, int] | None]
    step: Final[int | None]
    balance_by: Final[str | Sequence[str] | None]
    where: Final[Mapping[str, Any] | None]
    order_by: Final[str | None]
    prefer_local: Final[bool]
    max_staleness: Final[int | None]
    inline: Final[bool] = True  # (acquire's own two: a get's values come inline, under the daemon's lease timeout)
    lease_timeout: Final[float | None] = None
    per_lease: Final[int] = 0  # (leases taken ahead: the samples in leases of this many each)

    def frame(self, home: int) -> pb.Frame:
        """The acquire as the frame that is sent (its request is `frame.acquire`), every argument
        checked; `home`: this client's home warehouse (for prefer_local), -1 while it has none."""
        validate.check_partition(self.partition)
        validate.consumer_and_columns(self.consumer, self.columns)
        count = self.count
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 1:
            raise DockValueError(f"count must be a positive int, got {count!r}")
        if count > limits.MAX_SAMPLES:
            raise DockValueError(f"count must be at most {limits.MAX_SAMPLES} samples per get, got {count!r}")
        timeout = validate.seconds(self.timeout)
        frame = pb.Frame(acquire={"partition": self.partition, "consumer": self.consumer, "columns": self.columns,
                                  "count": int(count), "groups": self.groups, "allow_partial": self.allow_partial,
                                  "shuffle": self.shuffle, "inline": self.inline,
                                  "timeout": -1.0 if timeout is None else timeout})
        req = frame.acquire
        # (a plain get has none of these: two calls that would check nothing are not made)
        dp_rank, dp_size, mp_group, step, balance_by = self.dp_rank, self.dp_size, self.mp_group, self.step, self.balance_by
        if dp_rank is not None or dp_size is not None or mp_group is not None or step is not None or balance_by:
            validate.rank_fields(req, dp_rank, dp_size, mp_group, step, balance_by)
        seed, where, max_staleness, order_by, lease_timeout = (self.seed, self.where, self.max_staleness, self.order_by,
                                                               self.lease_timeout)
        if seed is not None or where or max_staleness is not None or order_by or lease_timeout is not None:
            validate.acquire_options(req, seed=seed, where=where, max_staleness=max_staleness, order_by=order_by,
                                     lease_timeout=lease_timeout)
        if self.prefer_local and home >= 0:
            if req.dp_size:
                raise DockValueError("prefer_local does not apply to rank-aware gets (dp_size or mp_group): a "
                                     "step's batch is one for all ranks")
            req.near = home + 1
        if self.per_lease:
            req.per_lease = self.per_lease
        req.token = ids.random_bits(63) | 1  # a retried acquire gets the lease its lost reply carried
        return frame
