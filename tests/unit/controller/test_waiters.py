"""Waiting gets (`dockd.controller.waiters`). Driven directly, with a fake of the gets they are tried
with and a clock the test moves: the order they are tried in, their timeouts, a full state dir.
Then near gets (Dock.get(prefer_local=True)) in the service in-process, two fake remote warehouses:
when a commit wakes them, the samples a warehouse commits go to the waiting gets of that warehouse's
node first, ahead of earlier gets from other nodes, but no earlier get is passed over more than
PASS_OVER times."""

from __future__ import annotations

import asyncio

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller import selection
from dockd.controller.clock import Timers
from dockd.controller.core import Controller
from dockd.controller.lease_table import AcquireResult
from dockd.controller.waiters import PASS_OVER, Waiters
from dockd.errors import DockClosed, DockStateFull, DockTimeout
from tests.unit.controller.fakes import Dock, FakeClock, FakePeer


class Gets:
    """The gets a waiter is tried with: `ready` samples to hand out (None: the state dir is full)."""

    def __init__(self) -> None:
        self.ready: int | None = 0
        self.tried: list[str] = []  # the peer of each get tried, in order

    def attempt(self, peer: FakePeer, r: pb.AcquireRequest) -> AcquireResult | None:
        self.tried.append(peer.name)
        if self.ready is None:
            raise DockStateFull("the state dir is full")
        if self.ready < r.count:
            return None
        self.ready -= r.count
        return AcquireResult(1, np.arange(r.count), np.zeros((1, r.count), np.uint16))

    def reply(self, peer: FakePeer, frame: pb.Frame, r: pb.AcquireRequest, res: AcquireResult) -> None:
        peer.reply(frame, pb.Frame(acquire_reply=pb.AcquireReply(indexes=res.indexes.tolist())))

    def near_ready(self, r: pb.AcquireRequest) -> dict[int, int]:
        return {}


class Parked:
    """Waiters on a clock the test moves, with their gets and the times every waiter was retried."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.gets = Gets()
        self.retried = 0
        self.waiters = Waiters(Controller(), Timers(self.clock), retry_all=self.retry_all)
        self.waiters.gets = self.gets

    def retry_all(self) -> None:
        self.retried += 1
        self.waiters.wake_every()

    def park(self, name: str, count: int, consumer: str = "c", timeout: float = -1.0) -> tuple[FakePeer, pb.Frame]:
        peer = FakePeer(name)
        frame = pb.Frame(acquire=pb.AcquireRequest(partition="p", consumer=consumer, columns=["x"], count=count,
                                                   timeout=timeout))
        self.waiters.park(peer, frame)
        return peer, frame

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.waiters.timers.run_due()


def test_a_wake_tries_waiting_gets_in_order_and_skips_those_a_smaller_one_could_not_meet():
    async def main():
        w = Parked()
        a, fa = w.park("a", 2)
        b, fb = w.park("b", 3)  # as many as a or more, same kind: not tried once a found too few
        c, fc = w.park("c", 1)
        other, fo = w.park("other", 3, consumer="d")  # another consumer: tried on its own
        w.gets.ready = 1
        w.waiters.wake("p")
        assert w.gets.tried == ["a", "c", "other"]
        assert Dock.answer(c, fc).acquire_reply.indexes == [0] and Dock.answer(a, fa) is None
        assert w.waiters.count == 3 and a.parked == b.parked == other.parked == 1 and c.parked == 0
        w.gets.ready, w.gets.tried = 5, []
        w.waiters.wake("p")
        assert w.gets.tried == ["a", "b", "other"]  # in arrival order; "other" finds none left
        assert Dock.answer(a, fa) is not None and Dock.answer(b, fb) is not None and w.waiters.count == 1

    asyncio.run(main())


def test_a_waiting_get_times_out_on_the_clock_with_what_was_ready():
    async def main():
        w = Parked()
        peer, frame = w.park("a", 4, timeout=5.0)
        w.advance(4.9)
        assert Dock.answer(peer, frame) is None
        w.advance(0.2)
        err = Dock.answer(peer, frame)
        assert isinstance(err, DockTimeout) and "0 of 4 samples were ready" in str(err)
        assert w.waiters.count == 0 and peer.parked == 0

    asyncio.run(main())


def test_a_full_state_dir_keeps_every_get_waiting_and_retries_them_all_a_second_later():
    async def main():
        w = Parked()
        a, fa = w.park("a", 1)
        b, fb = w.park("b", 1, consumer="d")
        w.gets.ready = None
        w.waiters.wake("p")
        assert w.gets.tried == ["a"] and w.waiters.count == 2  # (the first refusal stops the wake)
        w.gets.ready = 2
        w.advance(0.9)
        assert w.retried == 0
        w.advance(0.2)
        assert w.retried == 1 and Dock.answer(a, fa) is not None and Dock.answer(b, fb) is not None

    asyncio.run(main())


def test_closed_waiters_answer_every_get_and_retry_nothing():
    async def main():
        w = Parked()
        a, fa = w.park("a", 1)
        w.gets.ready = None
        w.waiters.wake("p")  # a retry is due in a second ...
        w.waiters.close(DockClosed("the controller is shutting down"))
        assert isinstance(Dock.answer(a, fa), DockClosed) and w.waiters.count == 0
        w.advance(2.0)
        assert w.retried == 0 and len(w.waiters.timers) == 0

    asyncio.run(main())


class TwoWarehouses(Dock):
    def __init__(self) -> None:
        super().__init__()
        reg = pb.RegisterWarehouse(host="10.0.0.10", port=7000, capacity=1 << 30, instance=78)
        self.wids = [self.wid, self.svc.register(FakePeer("warehouse-2"), reg).id]

    def put_on(self, k: int, partition: str, n: int) -> np.ndarray:
        return self.svc.commit(pb.CommitRequest(partition=partition, columns=["x"], new_count=n,
                                                warehouse=self.wids[k], nbytes=8 * n)).indexes

    def got(self, peer: FakePeer, frame: pb.Frame) -> list[int] | None:
        out = self.answer(peer, frame)
        return None if out is None else list(out.acquire_reply.indexes)


def test_a_commit_goes_to_the_waiting_get_on_its_warehouse_before_earlier_ones():
    async def main():
        d = TwoWarehouses()
        d.put_on(1, "p", 1)  # two warehouses hold data: near matters
        d.put_on(0, "p", 1)
        a, b, f = FakePeer("a"), FakePeer("b"), FakePeer("fifo")
        d.get(a, "p", 2)  # the two samples above, so the gets below wait
        on1 = d.get(b, "p", 4, near=d.wids[1] + 1)  # waits first, on node 1
        on0 = d.get(a, "p", 4, near=d.wids[0] + 1)  # waits second, on node 0
        d.put_on(0, "p", 4)  # [2..5] on warehouse 0: to the node-0 get, though it came later
        assert d.got(a, on0) == [2, 3, 4, 5] and d.got(b, on1) is None
        d.put_on(1, "p", 4)
        assert d.got(b, on1) == [6, 7, 8, 9]
        # without near, arrival order: the first waiting get takes the commit, wherever it is
        first, second = d.get(f, "p", 4, consumer="fifo2"), d.get(a, "p", 4, consumer="fifo2")
        d.put_on(0, "p", 4)
        assert d.got(f, first) == [0, 1, 2, 3] and d.got(a, second) == [4, 5, 6, 7]
        d.svc.shutdown()

    asyncio.run(main())


def test_a_near_get_not_covered_by_its_warehouse_waits_its_turn():
    async def main():
        d = TwoWarehouses()
        d.put_on(1, "p", 1)
        d.put_on(0, "p", 1)
        a, b = FakePeer("a"), FakePeer("b")
        d.get(a, "p", 2)
        on1 = d.get(b, "p", 4, near=d.wids[1] + 1)
        on0 = d.get(a, "p", 4, near=d.wids[0] + 1)
        d.put_on(0, "p", 2)
        d.put_on(1, "p", 2)  # 2 + 2 ready: neither is covered locally, so the earlier get takes all four
        assert d.got(b, on1) == [2, 3, 4, 5] and d.got(a, on0) is None
        d.svc.shutdown()

    asyncio.run(main())


def test_an_earlier_get_is_passed_over_at_most_pass_over_times():
    async def main():
        d = TwoWarehouses()
        d.put_on(1, "p", 1)
        d.put_on(0, "p", 1)
        a, b = FakePeer("a"), FakePeer("b")
        d.get(a, "p", 2)
        starving = d.get(b, "p", 1, near=d.wids[1] + 1)  # its warehouse never gets anything
        for k in range(PASS_OVER):
            local = d.get(a, "p", 1, near=d.wids[0] + 1)
            d.put_on(0, "p", 1)
            assert d.got(a, local) == [2 + k] and d.got(b, starving) is None
        late = d.get(a, "p", 1, near=d.wids[0] + 1)
        d.put_on(0, "p", 1)  # passed over PASS_OVER times: it goes first now
        assert d.got(b, starving) == [2 + PASS_OVER] and d.got(a, late) is None
        d.svc.shutdown()

    asyncio.run(main())


def test_ready_by_warehouse_counts_samples_with_every_column_on_one_warehouse():
    async def main():
        d = TwoWarehouses()
        d.put_on(0, "p", 3)
        d.put_on(1, "p", 2)
        d.svc.commit(pb.CommitRequest(partition="p", columns=["y"], indexes=[0, 3], warehouse=d.wids[1], nbytes=16))
        part = d.svc.core.partitions["p"]
        for cols, want in ((["x"], {d.wids[0]: 3, d.wids[1]: 2}), (["x", "y"], {d.wids[1]: 1})):
            _, _, sub, gs = selection.view(part, "c", cols, 1, False)
            assert selection.ready_by_warehouse(part, sub, gs, cols) == want
        d.svc.shutdown()

    asyncio.run(main())
