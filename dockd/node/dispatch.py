"""Requests to handlers: one table from a frame's kind (the name of its `kind` oneof field) to the
function that serves it.

Before a request reaches its handler the dispatcher gives back the segment pins
the frame returns, refuses descriptors on anything but a put, refuses the
daemon-to-daemon kinds from client connections, and checks the bounds of
bodiless frames (a frame with a body was checked when it was admitted; an acquire's
are checked by the controller's handler, which reads its fields once for them and the get). A kind
the table does not hold (a reply, a handshake frame, a kind from a newer
protocol) is answered with a DockValueError naming it; the connection stays.

`controller_handlers` serves the controller's kinds with the controller hosted
in this process, or, without one, refuses them saying where the controller is.
While the dock's controllers disagree on their list or --shards (dockd.controller.agreement)
every kind but stats is refused with the reason.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.controller.agreement import Agreement
from dockd.errors import DockAuthError, DockProtocolError, DockValueError
from dockd.net import auth
from dockd.net.peer import Peer
from dockd.net.wire import check_protocol
from dockd.node.tasks import reply_when_done, spawn
from dockd.terms import CommitOutcome

#: What serves one request: (the connection, the frame, its body or None, descriptors it carried).
RequestHandler = Callable[[Peer, pb.Frame, Any, list[int]], None]

CONTROLLER_KINDS = frozenset({"acquire", "confirm", "release", "extend", "clear", "stats", "register", "commit",
                              "commits", "locate", "leave", "partition", "block"})
WAREHOUSE_KINDS = frozenset({"put", "fetch", "free", "measure", "dump", "hello", "replicate", "flush", "return_blocks"})
WEIGHTS_KINDS = frozenset({"weights_wait", "weights_read", "weights_relay"})  # dockd.warehouse.weights
DAEMON_KINDS = frozenset({"register", "commit", "commits", "leave", "free", "measure", "dump", "replicate", "block",
                          "weights_relay", "return_blocks"})  # only daemons of this dock
#: Every request kind a daemon serves (the rest of the Frame's kinds are replies and the handshake's).
SERVED_KINDS = CONTROLLER_KINDS | WAREHOUSE_KINDS | WEIGHTS_KINDS


def plain(fn: Callable[[Peer, pb.Frame], None]) -> RequestHandler:
    """A handler of a request that carries neither body nor descriptors."""
    return lambda peer, frame, body, fds: fn(peer, frame)


class Dispatcher:
    """Routes each request to the handler of its kind.

    Args:
        table: kind -> handler.
        server_auth: who may claim which role (its failures are counted).
        from_controller: whether a connection is this warehouse's link to a controller, which may send daemon kinds.
        unpin: gives back the segment pins a frame returns (peer, pins).
    """

    def __init__(self, table: dict[str, RequestHandler], server_auth: auth.ServerAuth,
                 from_controller: Callable[[Peer], bool], unpin: Callable[[Peer, Any], None]) -> None:
        self.table = table
        self.server_auth = server_auth
        self.from_controller = from_controller
        self.unpin = unpin

    def on_request(self, peer: Peer, frame: pb.Frame, body, fds: list[int]) -> None:
        kind = frame.WhichOneof("kind")
        if frame.unpin:
            self.unpin(peer, frame.unpin)
            if kind is None:  # a frame that only gives pins back
                return
        if fds and (kind != "put" or len(fds) > 1):
            for fd in fds:
                os.close(fd)
            raise DockProtocolError(f"a {kind} request cannot carry {len(fds)} file descriptors")
        if kind in DAEMON_KINDS and self.server_auth.roles and peer.role != auth.DAEMON \
                and not self.from_controller(peer):
            self.server_auth.failed("daemon_message")
            raise DockAuthError(f"a {kind} request is a daemon-to-daemon message; this connection is a client's")
        if body is None and kind != "acquire":  # (a frame with a body was checked when it was admitted; an
            limits.check(frame, kind)            # acquire, by its handler: `limits.acquire` reads its fields for both)
        handler = self.table.get(kind)
        if handler is None:
            raise DockValueError(f"unexpected request kind {kind!r}: this daemon serves "
                                 f"{', '.join(sorted(self.table))}")
        handler(peer, frame, body, fds)


def controller_handlers(ctl, *, where: Callable[[], str], join: str, agreement: Agreement | None = None,
                        token: bytes | None = None) -> dict[str, RequestHandler]:
    """The controller's kinds: served by `ctl` (a ControllerService), or without one refused
    (`where()`: this daemon's address, read when it refuses: a port of 0 is bound by then; `join`: its
    controller's). `agreement`: whether the dock's controllers agree on their list (several controllers);
    `token`: the dock's client token (--token-file), which a joining warehouse must hold too."""
    if ctl is None:
        def refuse(peer: Peer, frame: pb.Frame, body, fds) -> None:
            raise DockValueError(f"this daemon ({where()}) is a warehouse without the controller; "
                                 f"connect clients to the controller at {join}")

        return dict.fromkeys(CONTROLLER_KINDS, refuse)

    def commit(peer: Peer, frame: pb.Frame) -> None:
        idx = ctl.commit(frame.commit, functools.partial(commit_answer, ctl, peer, frame))  # (None: paced, later)
        if idx is not None:
            commit_answer(ctl, peer, frame, idx)

    def register(peer: Peer, frame: pb.Frame) -> None:
        reg = frame.register
        who = f"the warehouse at {reg.host}:{reg.port}"
        check_protocol(reg.protocol, who)
        if reg.token_told and peer.challenge is not None:  # (a warehouse of an older build tells nothing)
            auth.check_token_proof(peer.challenge, reg.token_proof, token, who)
        if agreement is not None and reg.controllers:
            agreement.check(reg.controllers, who, reg.shards)
        peer.reply(frame, pb.Frame(register_reply=ctl.register(peer, reg)))

    def partition(peer: Peer, frame: pb.Frame) -> None:
        op = frame.partition.WhichOneof("op")
        if op in ("save", "load", "seal"):  # (a seal may first take blocks of indexes back from their owners)
            spawn(reply_when_done(peer, frame, getattr(ctl, op)(frame.partition), "partition_reply"))
        else:
            peer.reply(frame, pb.Frame(partition_reply=ctl.partition(frame.partition)))

    table = {
        "acquire": ctl.acquire,
        "confirm": lambda peer, frame: peer.reply(frame, pb.Frame(confirm_reply=ctl.confirm(peer, frame.confirm))),
        "release": lambda peer, frame: peer.reply(frame, pb.Frame(release_reply=pb.ReleaseReply(
            released=ctl.release(peer, frame.release)))),
        "extend": lambda peer, frame: peer.reply(frame, pb.Frame(extend_reply=ctl.extend(peer, frame.extend))),
        "commit": commit,
        "commits": lambda peer, frame: peer.reply(frame, pb.Frame(commits_reply=ctl.commit_batch(frame.commits))),
        "block": lambda peer, frame: peer.reply(frame, pb.Frame(block_reply=ctl.block(peer, frame.block))),
        "stats": lambda peer, frame: peer.reply(frame, pb.Frame(stats_reply=ctl.stats())),
        "locate": lambda peer, frame: peer.reply(frame, ctl.locate(frame.locate)),
        "leave": lambda peer, frame: ctl.leave(peer, frame.leave),
        "register": register,
        "clear": lambda peer, frame: spawn(reply_when_done(peer, frame, _cleared(ctl.clear(frame.clear)),
                                                           "clear_reply")),
        "partition": partition,
    }
    if agreement is None:
        return {kind: plain(fn) for kind, fn in table.items()}
    return {kind: plain(fn if kind in ("stats", "leave") else _agreed(agreement, fn)) for kind, fn in table.items()}


def _agreed(agreement: Agreement, fn: Callable[[Peer, pb.Frame], None]) -> Callable[[Peer, pb.Frame], None]:
    def serve(peer: Peer, frame: pb.Frame) -> None:
        agreement.refuse()
        fn(peer, frame)

    return serve


async def _cleared(clearing) -> pb.ClearReply:
    return pb.ClearReply(samples=await clearing)


def commit_answer(ctl, peer: Peer, frame: pb.Frame, res: CommitOutcome) -> None:
    """A commit's answer: its indexes and where to copy the put (--replicas 2), or the error (at once, or
    once a commit that waited for its partition's consumers, max_pending, is applied)."""
    if res.error is not None:
        peer.reply_error(frame, res.error)
        return
    out = pb.Frame()
    ctl.commit_reply(frame.commit, res, out.commit_reply)  # (filled in place: wrapping a reply would copy it)
    peer.reply(frame, out)
