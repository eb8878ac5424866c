"""Puts and gets of a spread partition (``--shards NAME=S``, dockd.owners): the client does the spreading.

A spread partition is S ordinary partitions, its shards, on S controllers; its indexes number
them as one (dockd.client.spread: shard k's sample i is ``i * S + k``). This client's **home
shard** follows its home warehouse (`spread.home`; shard 0 while it has none):

- a put of new samples goes to the home shard, whole (a group is one shard's); a put with
  `indexes` goes to the one shard they all name (``index % S``), as that shard's own indexes.
- a get (or acquire) asks one shard at a time, as a get of an ordinary partition asks (waiting up
  to WAIT_S of its timeout: an allow_partial get takes what is there at the end of it), the next
  in turn when that one could not serve it, until its timeout (each shard is asked once more once
  the time is up: a get with timeout 0 asks every shard once) or every shard is sealed and drained
  (DockDrained). A client's gets start one shard further each time, so its threads wait on every
  shard and no shard's samples wait for long unseen. A shard whose controller cannot be reached is
  passed over while another can serve (one controller down stalls only its shard); when none is
  left, its DockConnectionError is raised.

FIFO order holds within a shard, not across them; staleness order is per shard. Rank-aware gets
(dp_size, mp_group) and prefer_local are refused: a step's batch is one for all ranks and lives
on one controller.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dockd.client import put as puts
from dockd.client import spread as spread_mod
from dockd.client import validate
from dockd.client.lease import Lease
from dockd.client.options import GetOptions
from dockd.client.router import Router
from dockd.client.scope import CallScope
from dockd.client.spread import Spread
from dockd.errors import DockClosed, DockConnectionError, DockDrained, DockTimeout, DockValueError

WAIT_S = 0.25
"""Seconds a spread get waits on one shard (for what it asks, as a get of an ordinary partition
waits) before it asks the next shard in turn."""


def home_shard(router: Router, count: int) -> int:
    """This client's home shard among `count` (`spread.home`: its home warehouse's; 0 while it has none)."""
    return spread_mod.home(router.home, len(router.controllers), count)


def put(router: Router, warned: set[str], spread: Spread, columns: Mapping[str, Any], *,
        indexes: Sequence[int] | None, **kwargs: Any) -> list[int]:
    """Dock.put to spread partition `spread`: the indexes it returns are the spread partition's."""
    k = home_shard(router, spread.count)
    local = indexes
    if indexes is not None:
        idx = validate.int_list("indexes", indexes)
        if any(i < 0 for i in idx):
            raise DockValueError(f"indexes must be >= 0, got {min(idx)}")
        by_shard = spread.inward(idx)
        if len(by_shard) > 1:
            raise DockValueError(
                f"put(indexes=...) to spread partition {spread.name!r} names samples of {len(by_shard)} of its "
                f"{spread.count} shards ({sorted(by_shard)}): put each shard's indexes apart; index % "
                f"{spread.count} is the shard")
        if by_shard:
            (k, (_, local)), = by_shard.items()
    got = puts.put(router, warned, columns, partition=spread.shard(k), indexes=local, **kwargs)
    return spread.outward(k, got)


def refuse_ranks(spread: Spread, opts: GetOptions) -> None:
    """What a spread partition cannot serve: rank-aware gets and prefer_local."""
    if opts.dp_size is not None or opts.dp_rank is not None or opts.mp_group is not None or opts.step is not None:
        raise DockValueError(
            f"partition {spread.name!r} is spread over {spread.count} controllers (--shards): rank-aware gets "
            "(dp_rank/dp_size, mp_group, step) are refused there, because a step's batch is one for all ranks and "
            "lives in one controller; use an ordinary partition for rank-aware gets")
    if opts.prefer_local:
        raise DockValueError(
            f"partition {spread.name!r} is spread over {spread.count} controllers (--shards): prefer_local is "
            "refused there (its gets take from this client's home shard first already); drop prefer_local, or "
            "use an ordinary partition")


def take(spread: Spread, opts: GetOptions, first: int, acquire: Callable[[GetOptions], Lease],
         scope: CallScope | None = None) -> tuple[int, Lease]:
    """A get's or acquire's lease from a shard of `spread` that can serve `opts`, asked in turn from
    shard `first` on (see the module's docstring): (that shard's k, its lease, with the shard's
    partition name and own indexes). `acquire` takes one shard's options (`opts` with the shard's
    partition and a timeout)."""
    refuse_ranks(spread, opts)
    timeout = validate.seconds(opts.timeout)
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    shards = {k: dataclasses.replace(opts, partition=spread.shard(k)) for k in range(spread.count)}
    drained: set[int] = set()
    down: dict[int, DockConnectionError] = {}  # shards whose controller could not be reached when last asked
    late: set[int] = set()  # shards asked once the get's time was up
    most = 0  # the most samples a shard had ready
    k = first
    while True:
        if k not in drained:
            left = deadline - time.monotonic()
            try:
                return k, acquire(dataclasses.replace(shards[k], timeout=max(0.0, min(left, WAIT_S))))
            except DockTimeout as e:  # (not enough there in this turn)
                most = max(most, e.ready)
                down.pop(k, None)
            except DockDrained:
                drained.add(k)
            except DockConnectionError as e:  # (its controller is down: the other shards serve meanwhile)
                down[k] = e
            if left <= 0:
                late.add(k)
        if len(drained) == spread.count:
            raise DockDrained(f"spread partition {spread.name!r} is sealed and all its {spread.count} shards are "
                              "drained for this consumer")
        if len(drained) + len(down) == spread.count:  # (nothing left that could serve it)
            raise next(iter(down.values()))
        if len(late | drained) == spread.count:  # (every shard asked once more after the time was up)
            unreachable = "".join(f"; shard {j}: {e}" for j, e in down.items())
            raise DockTimeout(f"spread partition {spread.name!r} over {spread.count} shards: none had {opts.count} "
                              f"samples ready for consumer {opts.consumer!r} within {timeout:g}s (the most: {most})"
                              f"{unreachable}", ready=most)
        if scope is not None and scope.cancelled:
            raise DockClosed("the get was cancelled")
        k = (k + 1) % spread.count
