"""Relay planning (dockd.weights.relay): chains, trees, and warehouses whose parent failed."""

from __future__ import annotations

import pytest

from dockd.errors import DockValueError
from dockd.weights.relay import RelayPlan


def test_a_chain_by_default():
    plan = RelayPlan(origin=0)
    assert [plan.join(w) for w in (5, 3, 9)] == [0, 5, 3]
    assert plan.join(3) == 5  # asked again: the same parent
    assert [plan.depth(w) for w in (0, 5, 3, 9)] == [0, 1, 2, 3]
    assert plan.children(0) == 1  # the origin's link carries each byte once


def test_a_tree_with_fanout():
    plan = RelayPlan(origin=0, fanout=2)
    parents = [plan.join(w) for w in range(1, 8)]
    assert parents == [0, 0, 1, 1, 2, 2, 3]
    assert max(plan.depth(w) for w in range(1, 8)) == 3
    assert plan.children(0) == 2


def test_a_failed_parent_is_replaced_without_a_cycle():
    plan = RelayPlan(origin=0)
    for w in (1, 2, 3, 4):
        plan.join(w)  # 0 -> 1 -> 2 -> 3 -> 4
    assert plan.join(3, failed_parent=2) == 1  # 2 is gone: 3 (and 4 below it) move under 1
    assert plan.below(3) == {4}
    assert plan.join(4) == 3
    assert plan.join(5) == 4  # the chain goes on at its tail; nobody is sent to 2
    assert 2 not in plan.parent.values()


def test_no_cycle_when_only_descendants_have_room():
    plan = RelayPlan(origin=0)
    plan.join(1)
    plan.join(2)  # 0 -> 1 -> 2
    assert plan.join(1, failed_parent=0) == 0  # the origin is never written off
    with pytest.raises(DockValueError, match="origin"):
        plan.join(0)
    with pytest.raises(DockValueError, match="fanout"):
        RelayPlan(0, fanout=0)
