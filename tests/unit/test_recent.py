"""`Recent.add_all` keeps exactly what `add` one by one keeps: the same entries in the same order, the same
cells held, whatever the bounds, the sizes and the keys added again."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dockd.recent import Recent


def _state(r: Recent) -> tuple[list, int]:
    return [(k, v if isinstance(v, range) else v.tolist()) for k, v in r.items()], r.held


@pytest.mark.parametrize("seed", range(40))
def test_add_all_keeps_what_adding_one_by_one_keeps(seed):
    rng = random.Random(seed)
    count, cells = rng.randint(1, 12), rng.randint(0, 40)
    one, many = Recent(count, cells), Recent(count, cells)
    for _ in range(rng.randint(1, 6)):
        items = []
        for _ in range(rng.randint(0, 15)):
            key = rng.randint(0, 20)  # (few keys: many are added again, some after they went)
            n = rng.randint(0, 12)
            items.append((key, range(n) if rng.random() < 0.3 else np.arange(n, dtype=np.int64)))
        for key, value in items:
            one.add(key, value)
        many.add_all(items)
        assert _state(many) == _state(one)
        assert len(many) <= max(count, 1)


def test_a_key_added_again_in_one_go_after_the_bounds_dropped_it_is_new_again():
    one, many = Recent(10, 5), Recent(10, 5)
    items = [(1, np.arange(4)), (2, np.arange(4)), (1, range(0))]  # (1 went when 2 came: added again, it is newest)
    for key, value in items:
        one.add(key, value)
    many.add_all(items)
    assert list(one.keys()) == list(many.keys()) == [2, 1] and one.held == many.held == 4
