"""Blocks of indexes (`--commit-window`) whose owner moved past them (`dockd.controller.blocks.passed`): a
warehouse's side (`dockd.warehouse.blocks`: puts take indexes from its blocks in order, a put that does not
fit the rest of one starts the next, a put that fails to store leaves a hole, a grant whose answer was
lost is never used) against the controller's registry, their commits delivered in the order the puts took
their indexes, in batches, late. In process."""

from __future__ import annotations

from collections import deque

import numpy as np

from dockd.controller import blocks
from dockd.controller.core import Controller
from dockd.warehouse.blocks import Blocks as WarehouseBlocks

WID = 3


def _stream(puts: int, *, seed: int, drop_passed: bool) -> tuple[Controller, list[int], int]:
    """`puts` puts of 1..23 samples through one warehouse's blocks; (the controller, the samples its puts
    were answered with, the most blocks its registry held at once)."""
    rng = np.random.default_rng(seed)
    core = Controller()
    mine = WarehouseBlocks(clock=lambda: 0.0)
    on_the_way: deque[tuple[int, np.ndarray]] = deque()  # commits sent, not applied yet (in order)
    acked: list[int] = []
    most = 0

    def deliver(n: int) -> None:
        batch = [on_the_way.popleft() for _ in range(min(n, len(on_the_way)))]
        for bid, idx in batch:
            verdict, _ = blocks.judge(core.catalog, core.blocks, bid, WID, "p", idx.tolist(), columns=["x"])
            assert verdict == blocks.APPLY, (bid, idx.tolist(), verdict)  # (never a put on its way: CLEARED)
            core.commit("p", ["x"], warehouse=WID, indexes=idx, nbytes=8 * len(idx))
        done = [b.id for bid, _ in batch if (b := core.blocks.get(bid)) is not None
                and blocks.written_out(core.partitions.get("p"), b)]
        core.drop_blocks(done)
        if drop_passed:
            core.drop_blocks(blocks.passed(core.blocks, [(bid, WID, "p") for bid, _ in batch]))

    for _ in range(puts):
        count = int(rng.integers(1, 24))
        want = mine.wants("p", count, 1)
        if want:
            b = core.grant_block("p", WID, want, 1)
            if rng.random() < 0.03:
                mine.failed("p")  # (its answer was lost: the block is never used)
            else:
                mine.granted("p", b.id, b.start, b.count, 1)
        taken = mine.take("p", count, 1)
        if taken is not None:
            if rng.random() < 0.05:
                continue  # (the put failed to store: a hole)
            on_the_way.append(taken)
            acked += taken[1].tolist()
        if rng.random() < 0.3:
            deliver(int(rng.integers(1, 12)))
        most = max(most, len(core.blocks))
    deliver(len(on_the_way))
    return core, acked, most


def test_blocks_with_holes_that_their_owner_moved_past_are_dropped_and_no_put_on_its_way_is_lost():
    """20,000 puts: the registry held a block per 16 puts or so that had a hole (1,200 and growing for as
    long as the warehouse lived); now at most the few its owner still takes from. Every answered put's
    samples are written, the holes deleted (never handed out)."""
    for seed in range(3):
        core, acked, most = _stream(20000, seed=seed, drop_passed=True)
        part = core.partitions["p"]
        assert part.ready[np.asarray(acked)].all() and not part.gone[np.asarray(acked)].any()
        assert most <= 8 and len(core.blocks) <= 2, (most, len(core.blocks))
        unwritten = np.flatnonzero(part.ready[: part.size] == 0)
        held = {i for b in core.blocks.by_id.values() for i in range(b.start, b.stop)}
        assert set(unwritten.tolist()) - held <= set(np.flatnonzero(part.gone[: part.size]).tolist())


def test_only_the_blocks_of_that_owner_and_partition_granted_before_go():
    core = Controller()
    b1 = core.grant_block("p", 1, 8, 1)
    b2 = core.grant_block("q", 1, 8, 1)
    b3 = core.grant_block("p", 2, 8, 1)
    b4 = core.grant_block("p", 1, 8, 1)
    b5 = core.grant_block("p", 1, 8, 1)
    assert blocks.passed(core.blocks, [(b4.id, 1, "p")]) == [b1.id]
    assert blocks.passed(core.blocks, [(b4.id, 1, "p"), (b5.id, 1, "p")]) == [b1.id, b4.id]
    assert blocks.passed(core.blocks, [(b5.id, 2, "p"), (b5.id, 1, "q"), (99, 1, "p")]) == []  # (not theirs)
    assert blocks.passed(core.blocks, [(b3.id, 2, "p"), (b2.id, 1, "q")]) == []
