"""A lease cut into one per get (leases taken ahead, AcquireRequest.per_lease), on the pure controller."""

from __future__ import annotations

from dockd.controller.core import Controller


def test_a_split_lease_is_one_per_get_each_confirmed_or_released_alone():
    c = Controller(lease_timeout=10.0)
    c.commit("p", ["x"], warehouse=0, new_count=7)
    r = c.acquire("p", "t", ["x"], 7, token=99, now=0.0)
    parts = c.book.split(r.lease, 3)
    assert [p.indexes.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert parts[0].id == r.lease and c.lease_tokens[99] == r.lease  # the first keeps its id and token
    assert len({p.id for p in parts}) == 3 and all(p.deadline == 10.0 for p in parts)
    cons = c.partitions["p"].consumers["t"]
    assert c.confirm(parts[1].id) and c.release(parts[2].id) is not None
    assert (cons.taken, cons.leased) == (3, 3)
    assert c.acquire("p", "t", ["x"], 1, now=0.0).indexes.tolist() == [6]  # the released one, at once
    assert parts[0].id in {lease.id for lease in c.expire_leases(10.0)}  # the one still held expires as any
    assert cons.leased == 0 and cons.taken == 3


def test_split_leases_expire_in_grant_order_with_the_others():
    c = Controller(lease_timeout=10.0)
    c.commit("p", ["x"], warehouse=0, new_count=6)
    first = c.acquire("p", "t", ["x"], 4, now=0.0, token=1)
    parts = c.book.split(first.lease, 2)
    later = c.acquire("p", "t", ["x"], 2, now=1.0)
    expired = c.expire_leases(10.5)
    assert [lease.id for lease in expired] == [p.id for p in parts]  # (the later lease is not due yet)
    assert c.leases.keys() == {later.lease}
    assert c.acquire("p", "t", ["x"], 4, now=11.0).indexes.tolist() == [0, 1, 2, 3]
