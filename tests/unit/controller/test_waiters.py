"""Waiting gets that asked for their own warehouse's samples (near, Dock.get(prefer_local=True)):
when a commit wakes them, the samples a warehouse commits go to the waiting gets of that warehouse's
node first, ahead of earlier gets from other nodes, but no earlier get is passed over more than
PASS_OVER times. The controller service in-process, two fake remote warehouses."""

from __future__ import annotations

import asyncio

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.controller import selection
from dockd.controller.waiters import PASS_OVER
from tests.unit.controller.fakes import Dock, FakePeer


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
