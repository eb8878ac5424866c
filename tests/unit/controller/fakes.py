"""Fakes for driving the controller's service and its helpers in-process (no sockets): a clock the
test moves by hand, connections whose replies are recorded, and a dock of one remote warehouse."""

from __future__ import annotations

import asyncio

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller.clock import Timers
from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.membership import Membership
from dockd.controller.service import ControllerService
from dockd.net import auth
from dockd.net.peer import Peer


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakePeer(Peer):
    """A client or warehouse connection as the service sees it (a Peer never connected): replies are recorded."""

    def __init__(self, name: str = "client", session: bytes = b"") -> None:
        super().__init__(None, max_body=0)  # (nothing is read: no handler)
        self.name, self.session, self.role = name, session, auth.CLIENT
        self.replies: list[tuple[pb.Frame, object]] = []  # (request frame, reply frame or exception)

    def reply(self, frame, out, *rest, tail: bytes = b"") -> None:
        if tail:  # (a serialized part the wire appends to the frame, merged on the peer's parse)
            out.MergeFromString(tail)
        self.replies.append((frame, out))

    def reply_error(self, frame, exc) -> None:
        self.replies.append((frame, exc))


class Dock:
    """A service with one remote warehouse (a fake connection) and helpers to put and get."""

    def __init__(self, *, lease_timeout: float = 30.0, grace: float = 15.0) -> None:
        self.clock = FakeClock()
        self.svc = ControllerService(Controller(lease_timeout=lease_timeout), warehouse_grace=grace, clock=self.clock)
        self.probed = []

        async def cannot_tell(host, port):  # the probe of a dropped warehouse's address: no answer either way
            self.probed.append((host, port))
            return None

        self.svc.members.probe = cannot_tell
        self.wpeer = FakePeer("warehouse")
        reg = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=77)
        self.wid = self.svc.register(self.wpeer, reg).id

    async def advance(self, seconds: float) -> None:
        """Move the clock and run what fell due, then let the loop run what that scheduled."""
        self.clock.now += seconds
        self.svc.timers.run_due()
        for _ in range(3):
            await asyncio.sleep(0)

    def put(self, partition: str, n: int, **kw) -> np.ndarray:
        return self.svc.commit(pb.CommitRequest(partition=partition, columns=["x"], new_count=n, warehouse=self.wid,
                                                nbytes=8 * n, **kw)).indexes

    def get(self, peer: FakePeer, partition: str, count: int, *, consumer: str = "c", timeout: float = -1.0,
            **kw) -> pb.Frame:
        frame = pb.Frame(acquire=pb.AcquireRequest(partition=partition, consumer=consumer, columns=["x"],
                                                   count=count, timeout=timeout, **kw))
        self.svc.acquire(peer, frame)
        return frame

    @staticmethod
    def answer(peer: FakePeer, frame: pb.Frame):
        """The reply to one request (None while it waits)."""
        got = [out for f, out in peer.replies if f is frame]
        assert len(got) <= 1
        return got[0] if got else None


def run(coro):
    return asyncio.run(coro)


class Journaled:
    """A controller core rebuilt from a journal in `state_dir` (locked, as a service's), with membership
    and timers on a clock the test moves: what the tests of one part of the service build it on."""

    def __init__(self, state_dir) -> None:
        self.clock = FakeClock()
        self.timers = Timers(self.clock)
        self.journal = Journal(state_dir)
        self.journal.lock()
        self.core, _ = self.journal.load(lease_timeout=30.0, now=self.clock())
        self.members = Membership(self.core, self.journal, grace=15.0, on_change=lambda: None, timers=self.timers)

    def restarted(self) -> Controller:
        """The core a restart rebuilds from what was journaled (this journal closed first)."""
        self.journal.close()
        core, _ = Journal(self.journal.dir).load(lease_timeout=30.0, now=self.clock())
        return core
