"""Several controllers must agree on their list (and spread partitions), or the dock refuses service.

The owner of a partition is computed from the --controllers list alone (dockd.owners), so two
controllers given different lists (another order, another length) would each own partitions the
other also owns, or none: a put acknowledged by one could be unknown to the other. The list is
therefore part of the dock, checked whenever two of its daemons meet:

- a controller asks every other controller of its list for theirs (a Hello, at start and then
  every `PROBE_INTERVAL` seconds, `dockd.node.controller_probe`), and while any of them
  differs it refuses every controller request (`DockConfigError`), so nothing is split;
- a warehouse registering with a controller presents the list it learned, and is refused when it
  differs;
- a client presents the list it learned from its first controller in its Hello to the others, and
  checks theirs.

The spread partitions (--shards, dockd.owners) are part of the same identity: they decide which
controller owns each shard, so they are presented and compared with the list, and a daemon or
client that differs on them is refused alike. A request naming a spread partition's own name
(`refuse_spread`) comes from a client that does not spread it, and is refused too: nothing is
ever recorded under that name.

The refusal ends by itself once the lists agree again (the misconfigured controller restarted
with the right list). This module holds the rule and the state, with no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from dockd.errors import DockConfigError, DockValueError
from dockd.owners import differs, disagreement, owner_index, shard_name, shard_names

logger = logging.getLogger(__name__)

PROBE_INTERVAL = 10.0
"""Seconds between a controller's checks of another controller's list once it answered (2 s until then)."""


def refuse_spread(shards: Mapping[str, int], partition: str) -> None:
    """Raise DockValueError when `partition` is a spread partition's own name (in `shards`, the dock's
    --shards): its samples live in its shards, which a client of this version puts to and gets from."""
    count = shards.get(partition)
    if count is not None:
        raise DockValueError(
            f"partition {partition!r} is spread over {count} shards (--shards): its samples live in partitions "
            f"{shard_name(partition, 0, count)} to {shard_name(partition, count - 1, count)}; this request came "
            "from a client that does not know it (a client of a dockd version before --shards, or a raw "
            "request): connect with a current client")


class Ownership:
    """Which partitions' requests this controller serves: those `owners.owner_index` gives it among the
    dock's `controllers` (every one when there are none: it is the dock's only controller; `own`: its
    place among them), and none named after a spread partition (`shards`, --shards: `refuse_spread`)."""

    def __init__(self, controllers: tuple[str, ...] = (), own: int = 0, shards: Mapping[str, int] | None = None):
        self.controllers, self.own, self.shards = controllers, own, dict(shards or {})

    def check(self, partition: str) -> None:
        """Refuse a request about a partition another controller owns (clients and warehouses route
        by the same list, so only a client that knows another list, or none, gets here), or about a
        spread partition's own name (one dict lookup for every other partition)."""
        if partition in self.shards:
            refuse_spread(self.shards, partition)
        if self.controllers and (k := owner_index(partition, len(self.controllers))) != self.own:
            raise DockValueError(f"partition {partition!r} belongs to the controller at {self.controllers[k]}, not to "
                                 f"this one ({self.controllers[self.own]}); the dock's controllers are "
                                 f"{','.join(self.controllers)}: connect with a client of this dockd version")


class Agreement:
    """This controller's view of whether the dock's controllers agree on their list and spread partitions.

    Args:
        controllers: this controller's --controllers (empty: it is the dock's only controller).
        where: this controller's address, for messages.
        shards: this controller's --shards (spread partition -> its shard count).
        replicas: this controller's --replicas (every controller keeps the same number of copies).
    """

    def __init__(self, controllers: Sequence[str], where: str, shards: Mapping[str, int] | None = None,
                 replicas: int = 1) -> None:
        self.controllers = tuple(controllers)
        self.shards = shard_names(shards or {})  # (as they travel and are compared)
        self.where = where
        self.replicas = replicas
        self._differing: dict[str, str] = {}  # address of a controller whose list differs -> the refusal
        self._agreeing: set[str] = set()  # addresses of the other controllers that answered with our list

    @property
    def refusal(self) -> str:
        """Why this controller refuses service now ('' while every controller it reached agrees)."""
        return next(iter(self._differing.values()), "")

    def _differs(self, theirs: Sequence[str], their_shards: Sequence[str]) -> bool:
        return differs(self.controllers, theirs, self.shards, their_shards)

    def check(self, theirs: Sequence[str], where: str, their_shards: Sequence[str] = ()) -> None:
        """A daemon or client at `where` presents its list and spread partitions (an empty list: it knows
        none yet, nothing to compare): raise DockConfigError when either differs from ours."""
        if theirs and self._differs(theirs, their_shards):
            msg = disagreement(self.controllers, f"the controller at {self.where}", theirs, where,
                               self.shards, their_shards)
            if self.shards and not their_shards and not differs(self.controllers, theirs):
                msg += (f"; {where} may simply predate --shards (a dockd version that presents none): "
                        "upgrade it")
            raise DockConfigError(msg)

    def observed(self, address: str, theirs: Sequence[str] | None, refusal: str = "",
                 their_shards: Sequence[str] = (), their_replicas: int = 0) -> None:
        """The controller at `address` answered with its list (`theirs`), spread partitions
        (`their_shards`) and --replicas (`their_replicas`, 0: a version that does not say), or refused
        ours (`refusal`)."""
        if refusal:
            msg = refusal
        elif theirs is not None and self._differs(theirs, their_shards):
            msg = disagreement(self.controllers, f"this controller ({self.where})", theirs,
                               f"the controller at {address}", self.shards, their_shards)
        elif their_replicas and their_replicas != self.replicas:
            msg = (f"the controller at {address} keeps --replicas {their_replicas}, this controller ({self.where}) "
                   f"--replicas {self.replicas}: the dock would keep some partitions twice and others once; give "
                   "every controller the same --replicas")
        else:
            msg = ""
        if msg or theirs is None:
            self._agreeing.discard(address)
        else:
            self._agreeing.add(address)
        before = self._differing.get(address, "")
        if msg and msg != before:
            logger.error("[controllers] refusing service: %s", msg)
            self._differing[address] = msg
        elif not msg and before:
            del self._differing[address]
            logger.warning("[controllers] the controller at %s now has this controller's list and --shards%s", address,
                           "; serving again" if not self._differing else "")

    def all_agree(self) -> bool:
        """Whether every other controller of the list answered, and with our list, --shards and --replicas."""
        return not self._differing and self._agreeing >= {a for a in self.controllers if a != self.where}

    def refuse(self) -> None:
        """Raise DockConfigError while the controllers disagree."""
        if self._differing:
            raise DockConfigError(self.refusal)
