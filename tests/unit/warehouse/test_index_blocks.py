"""A warehouse's blocks of new indexes (`dockd.warehouse.blocks`, --commit-window): what a put takes,
when the next block is asked for and how big, refusals, and blocks given back or dropped."""

from __future__ import annotations

from dockd.warehouse.blocks import MAX_BLOCK, MIN_BLOCK, PUTS_PER_BLOCK, REFUSED_BACKOFF_S, Blocks


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_puts_take_consecutive_indexes_and_the_next_block_is_asked_for_at_half():
    b = Blocks()
    assert b.take("p", 2, 1) is None  # (no block yet)
    size = b.wants("p", 2, 1)
    assert size == max(MIN_BLOCK, 2 * PUTS_PER_BLOCK)
    assert b.wants("p", 2, 1) == 0  # (one request at a time)
    b.granted("p", 7, 1000, size, 1)
    block, idx = b.take("p", 2, 1)
    assert block == 7 and idx.tolist() == [1000, 1001]
    taken = 2
    while (size - taken) * 2 > size:
        assert b.wants("p", 2, 1) == 0  # (more than half is left)
        b.take("p", 2, 1)
        taken += 2
    assert b.wants("p", 2, 1) == size


def test_a_put_that_does_not_fit_the_rest_starts_the_next_block_and_leaves_a_hole():
    b = Blocks()
    b.wants("p", 4, 2)
    b.granted("p", 1, 0, 6, 2)
    b.granted("p", 2, 6, 8, 2)
    assert b.take("p", 4, 2)[1].tolist() == [0, 1, 2, 3]
    block, idx = b.take("p", 4, 2)  # (2 left in block 1: a hole)
    assert block == 2 and idx.tolist() == [6, 7, 8, 9]
    assert b.ids() == [2]


def test_a_put_bigger_than_the_largest_block_gets_one_of_its_size():
    b = Blocks()
    assert b.wants("p", MAX_BLOCK + 8, 8) == MAX_BLOCK + 8
    assert Blocks().wants("p", 3, 4) % 4 == 0  # (a multiple of the group size)


def test_a_refusal_is_not_asked_again_for_a_while():
    clock = _Clock()
    b = Blocks(clock)
    b.wants("p", 1, 1)
    b.granted("p", 0, 0, 0, 1)
    assert b.wants("p", 1, 1) == 0
    clock.now += REFUSED_BACKOFF_S + 0.01
    assert b.wants("p", 1, 1) > 0
    b.failed("p")  # (no answer: the next put asks again at once)
    assert b.wants("p", 1, 1) > 0


def test_dropped_and_forgotten_blocks_hand_out_nothing():
    b = Blocks()
    b.granted("p", 1, 0, 64, 1)
    b.granted("p", 2, 64, 64, 1)
    b.granted("q", 3, 0, 64, 1)
    b.forget(1)
    assert b.take("p", 1, 1)[0] == 2
    assert b.drop("p") == [2]
    assert b.take("p", 1, 1) is None
    b.clear()
    assert b.ids() == [] and b.take("q", 1, 1) is None
