"""Several controllers must agree on their list, or the dock refuses service.

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

The refusal ends by itself once the lists agree again (the misconfigured controller restarted
with the right list). This module holds the rule and the state, with no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dockd.errors import DockConfigError
from dockd.owners import differs, disagreement

logger = logging.getLogger(__name__)

PROBE_INTERVAL = 10.0
"""Seconds between a controller's checks of another controller's list once it answered (2 s until then)."""


class Agreement:
    """This controller's view of whether the dock's controllers agree on their list.

    Args:
        controllers: this controller's --controllers (empty: it is the dock's only controller).
        where: this controller's address, for messages.
    """

    def __init__(self, controllers: Sequence[str], where: str) -> None:
        self.controllers = tuple(controllers)
        self.where = where
        self._differing: dict[str, str] = {}  # address of a controller whose list differs -> the refusal

    @property
    def refusal(self) -> str:
        """Why this controller refuses service now ('' while every controller it reached agrees)."""
        return next(iter(self._differing.values()), "")

    def check(self, theirs: Sequence[str], where: str) -> None:
        """A daemon or client at `where` presents its list (empty: it knows none yet, nothing to
        compare): raise DockConfigError when it differs from ours."""
        if theirs and differs(self.controllers, theirs):
            raise DockConfigError(disagreement(self.controllers, f"the controller at {self.where}", theirs, where))

    def observed(self, address: str, theirs: Sequence[str] | None, refusal: str = "") -> None:
        """The controller at `address` answered with its list (`theirs`), or refused ours (`refusal`)."""
        if refusal:
            msg = refusal
        elif theirs is not None and differs(self.controllers, theirs):
            msg = disagreement(self.controllers, f"this controller ({self.where})", theirs,
                          f"the controller at {address}")
        else:
            msg = ""
        before = self._differing.get(address, "")
        if msg and msg != before:
            logger.error("[controllers] refusing service: %s", msg)
            self._differing[address] = msg
        elif not msg and before:
            del self._differing[address]
            logger.warning("[controllers] the controller at %s now has this controller's list%s", address,
                           "; serving again" if not self._differing else "")

    def refuse(self) -> None:
        """Raise DockConfigError while the controllers disagree."""
        if self._differing:
            raise DockConfigError(self.refusal)
