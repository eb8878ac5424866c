"""A warehouse link's commits (dockd.node.controller_link, its `link` here): one waiting for its answer
(`Pending`), an answer as its outcome, one that waited too long for an absent controller, and a windowed commit
held at the head of the queue while the controller's state dir is full."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockStateFull, from_status
from dockd.logutil import Throttle
from dockd.terms import CommitOutcome

logger = logging.getLogger("dockd.node.controller_link")  # (the link's own lines, under its name)

STATE_FULL_RETRY_S = 1.0  # seconds before a windowed commit refused for a full state dir goes again
_full_log = Throttle()


def outcome_of(reply: pb.CommitReply) -> CommitOutcome:
    """A commit's answer (`CommitReply`) as its outcome: the error its status carries, else the indexes,
    whether another warehouse holds a re-sent put's values, and where to copy the put."""
    if reply.status.code != pb.OK:
        return CommitOutcome(error=from_status(reply.status))
    return CommitOutcome(list(reply.indexes), stored=reply.stored, cleared=reply.cleared,
                         replica=reply.replica if reply.HasField("replica") else None)


def free_cleared(names, on_drop: Callable[[str], object], *, restarted: bool) -> None:
    """Free the partitions a rejoin's answer says the dock cleared while this warehouse and its controller
    were apart (`restarted`: this process's first join, on its data dir: the warehouse was the one down)."""
    for name in names:
        logger.info("[link] freeing partition=%s: the dock cleared it while %s", name,
                    "this warehouse was down (it restarted on its data dir)" if restarted else
                    "this warehouse was cut off from the controller")
        on_drop(name)


@dataclasses.dataclass(slots=True, eq=False)
class Pending:
    req: pb.CommitRequest
    fut: asyncio.Future
    limit: float                      # seconds this commit may wait for an absent controller
    sent: asyncio.Future | None = None  # the request on the wire (done the moment its reply is read)
    slot: int = -1                      # its place in the CommitBatch that carried it (-1: sent alone)
    timer: asyncio.TimerHandle | None = None
    windowed: bool = False              # its put was answered already (--commit-window): it never expires


def hold(link: Any, p: Pending, why: DockStateFull) -> None:
    """A windowed commit the controller could not record for a full state dir: its put was answered, so it
    goes again in STATE_FULL_RETRY_S, ahead of every commit made since (they wait behind it: a controller
    drops the blocks of a warehouse granted before the newest it commits to, so a commit overtaken by one of
    a later block would be cleared)."""
    _full_log.log(logger, logging.WARNING, "[link] the commit of a put answered before it waits for room in the "
                  "state dir of the controller at %s: %s", link.address, why)
    p.sent = None
    link._queue.insert(link._held, p)
    link._held += 1
    if link._flush_at is not None:
        link._flush_at.cancel()
    link._flush_at = asyncio.get_running_loop().call_later(STATE_FULL_RETRY_S, send_held, link)


def send_held(link: Any) -> None:
    link._held = 0
    link._flush()


def expire(link: Any, p: Pending) -> None:
    """A commit waited `p.limit` seconds for a controller that is not there: it fails (its put was not answered)."""
    p.timer = None
    if link.joined.is_set() or p.fut.done():
        return
    link._pending.pop(p.req.put_id, None)
    p.fut.set_result(CommitOutcome(error=DockConnectionError(
        f"the controller at {link.address} has been unreachable for {p.limit:g}s, so this put could not be "
        "committed and was not stored; retry it once the controller is back")))
