"""The controller's pure logic, called directly (no sockets, no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dockd.controller.core import Controller
from dockd.errors import DockDataLost, DockNotFound, DockValueError


def put(c: Controller, part: str, cols, n: int, wh: int = 0, gs: int = 1) -> list[int]:
    return c.commit(part, cols, warehouse=wh, new_count=n, group_size=gs).tolist()


def test_new_samples_get_consecutive_indexes_per_partition():
    c = Controller()
    assert put(c, "a", ["x"], 3) == [0, 1, 2]
    assert put(c, "a", ["x"], 2) == [3, 4]
    assert put(c, "b", ["x"], 2) == [0, 1]


def test_fifo_and_readiness_needs_every_requested_column():
    c = Controller()
    put(c, "p", ["prompts"], 4)
    assert c.acquire("p", "ref", ["prompts", "responses"], 1) is None
    c.commit("p", ["responses"], warehouse=1, indexes=[2, 0])
    r = c.acquire("p", "ref", ["prompts", "responses"], 2)
    assert r.indexes.tolist() == [0, 2]
    assert r.locations.tolist() == [[0, 0], [1, 1]]
    assert c.acquire("p", "ref", ["prompts", "responses"], 1) is None


def test_each_consumer_sees_every_sample_once():
    c = Controller()
    put(c, "p", ["x"], 5)
    a = c.acquire("p", "a", ["x"], 5)
    b = c.acquire("p", "b", ["x"], 5)
    assert a.indexes.tolist() == b.indexes.tolist() == [0, 1, 2, 3, 4]
    c.confirm(a.lease)
    assert c.acquire("p", "a", ["x"], 1) is None


def test_allow_partial_returns_what_is_ready():
    c = Controller()
    put(c, "p", ["x"], 3)
    assert c.acquire("p", "a", ["x"], 8) is None
    assert c.acquire("p", "a", ["x"], 8, allow_partial=True).indexes.tolist() == [0, 1, 2]
    assert c.acquire("p", "a", ["x"], 8, allow_partial=True) is None


def test_release_returns_samples_and_confirm_keeps_them():
    c = Controller()
    put(c, "p", ["x"], 4)
    r = c.acquire("p", "a", ["x"], 2)
    assert c.ready_count("p", "a", ["x"]) == 2
    c.release(r.lease)
    assert c.ready_count("p", "a", ["x"]) == 4
    r = c.acquire("p", "a", ["x"], 4)
    c.confirm(r.lease)
    assert c.ready_count("p", "a", ["x"]) == 0
    assert c.release(r.lease) is None  # confirmed leases are gone


def test_leases_of_a_lost_owner_and_expired_leases_return():
    c = Controller(lease_timeout=10)
    put(c, "p", ["x"], 4)
    c.acquire("p", "a", ["x"], 2, owner=b"7", now=0.0)
    c.acquire("p", "b", ["x"], 2, owner=b"8", now=5.0)
    assert [l.owner for l in c.release_owner(b"7")] == [b"7"]
    assert c.ready_count("p", "a", ["x"]) == 4
    assert c.next_lease_deadline() == 15.0
    assert c.expire_leases(14.9) == []
    assert len(c.expire_leases(15.0)) == 1
    assert c.ready_count("p", "b", ["x"]) == 4


def test_groups_are_handed_out_whole():
    c = Controller()
    put(c, "p", ["x"], 8, gs=4)
    c.commit("p", ["y"], warehouse=0, indexes=[0, 1, 2, 4, 5, 6, 7])
    assert c.acquire("p", "a", ["x", "y"], 8, groups=True) is None
    r = c.acquire("p", "a", ["x", "y"], 8, groups=True, allow_partial=True)
    assert r.indexes.tolist() == [4, 5, 6, 7]
    with pytest.raises(DockValueError, match="multiple of the group size 4"):
        c.acquire("p", "a", ["x"], 6, groups=True)


def test_group_size_mismatch_and_bad_counts_are_rejected():
    c = Controller()
    put(c, "p", ["x"], 8, gs=8)
    with pytest.raises(DockValueError, match="group_size=8"):
        put(c, "p", ["x"], 4, gs=4)
    with pytest.raises(DockValueError, match="multiple of group_size"):
        put(c, "q", ["x"], 6, gs=4)
    with pytest.raises(DockValueError, match="count must be >= 1"):
        c.acquire("p", "a", ["x"], 0)


def test_existing_index_writes_are_checked():
    c = Controller()
    put(c, "p", ["x"], 2)
    with pytest.raises(DockNotFound, match="do not exist"):
        c.commit("p", ["y"], warehouse=0, indexes=[5])
    with pytest.raises(DockNotFound, match="does not exist"):
        c.commit("nope", ["y"], warehouse=0, indexes=[0])
    with pytest.raises(DockValueError, match="already written"):
        c.commit("p", ["x"], warehouse=0, indexes=[1])
    with pytest.raises(DockValueError, match="duplicates"):
        c.commit("p", ["y"], warehouse=0, indexes=[1, 1])


def test_shuffle_is_seeded_and_complete():
    def order(seed):
        c = Controller()
        put(c, "p", ["x"], 100)
        out = []
        while (r := c.acquire("p", "a", ["x"], 7, shuffle=True, seed=seed, allow_partial=True)) is not None:
            out += r.indexes.tolist()
        return out

    a, b = order(1), order(1)
    assert a == b and sorted(a) == list(range(100)) and a != list(range(100))
    assert order(2) != a


def test_lost_warehouse_makes_loss_visible_once_per_consumer():
    c = Controller()
    put(c, "p", ["x"], 2, wh=0)
    put(c, "p", ["x"], 2, wh=1)
    c.warehouse_lost(1)
    assert c.acquire("p", "a", ["x"], 2).indexes.tolist() == [0, 1]
    with pytest.raises(DockDataLost) as e:
        c.acquire("p", "a", ["x"], 2)
    assert e.value.indexes == [2, 3] and e.value.columns == ["x"]
    assert c.acquire("p", "a", ["x"], 1) is None


def test_clear_forgets_the_partition_and_its_leases():
    c = Controller()
    put(c, "p", ["x"], 3)
    r = c.acquire("p", "a", ["x"], 1)
    assert c.clear("p") == 3
    assert r.lease not in c.leases
    assert r.lease in c.cleared_leases  # its late confirm is no news (see ControllerService._confirm)
    assert not c.confirm(r.lease)
    with pytest.raises(DockNotFound):
        c.clear("p")


def test_acquire_cost_does_not_grow_with_partition_size():
    """Counts work, not time: the blocks an acquire visits stay bounded by the batch."""
    c = Controller()
    for n in (10_000, 1_000_000):
        put(c, f"p{n}", ["x"], n)
        c.acquire(f"p{n}", "a", ["x"], 256)  # builds the subscription
        sub = next(iter(c.partitions[f"p{n}"].consumers["a"].subs.values()))
        before = sub.eligible.total
        r = c.acquire(f"p{n}", "a", ["x"], 256)
        assert r.indexes.tolist() == list(range(256, 512))
        assert sub.eligible.total == before - 256
        assert c.metadata_bytes(f"p{n}") / n < 64


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("put"), st.integers(1, 4)),
            st.tuples(st.just("col"), st.integers(0, 40)),
            st.tuples(st.just("get"), st.sampled_from("ab"), st.integers(1, 3), st.booleans()),
            st.tuples(st.just("end"), st.integers(0, 5), st.booleans()),
        ),
        max_size=60,
    )
)
def test_property_no_double_delivery_no_loss_groups_whole(ops):
    """Random puts/gets/releases: nothing delivered twice, groups never split, everything ready is delivered."""
    gs = 2
    c = Controller()
    size = 0
    delivered = {"a": [], "b": []}
    open_leases = []
    for op in ops:
        if op[0] == "put":
            size += len(put(c, "p", ["x"], op[1] * gs, gs=gs))
        elif op[0] == "col" and size:
            i = op[1] % size
            if not (c.partitions["p"].ready[i] & np.uint64(2)):
                c.commit("p", ["y"], warehouse=0, indexes=[i])
        elif op[0] == "get" and size:
            _, who, groups_n, partial = op
            r = c.acquire("p", who, ["x", "y"], groups_n * gs, groups=True, allow_partial=partial)
            if r is not None:
                idx = r.indexes.tolist()
                assert len(idx) % gs == 0
                for k in range(0, len(idx), gs):  # whole, contiguous groups
                    assert idx[k] % gs == 0 and idx[k : k + gs] == list(range(idx[k], idx[k] + gs))
                open_leases.append((who, r.lease, idx))
        elif op[0] == "end" and open_leases:
            who, lease, idx = open_leases.pop(op[1] % len(open_leases))
            if op[2]:
                c.confirm(lease)
                delivered[who] += idx
            else:
                c.release(lease)
    for who, lease, idx in open_leases:
        c.confirm(lease)
        delivered[who] += idx
    if size:  # make every sample ready, then drain: each consumer must end with every sample exactly once
        missing = [i for i in range(size) if not c.partitions["p"].ready[i] & np.uint64(2)]
        if missing:
            c.commit("p", ["y"], warehouse=0, indexes=missing)
        for who in "ab":
            while (r := c.acquire("p", who, ["x", "y"], gs, groups=True)) is not None:
                c.confirm(r.lease)
                delivered[who] += r.indexes.tolist()
    for who in "ab":
        assert sorted(delivered[who]) == list(range(size))


def _replay(ops, gs: int, few: int):
    """Run `ops` on a fresh controller with FEW = few; returns what every call answered and the final state."""
    from dockd.controller import eligible, partition

    saved, partition.FEW, eligible.FEW = partition.FEW, few, few
    try:
        c = Controller()
        answers, leases, size = [], [], 0
        for op in ops:
            if op[0] == "put":
                size += len(put(c, "p", ["x"], op[1] * gs, gs=gs))
            elif op[0] == "col" and size:
                idx = sorted({(op[1] + 7 * k) % size for k in range(op[2])})
                idx = [i for i in idx if not c.partitions["p"].ready[i] & np.uint64(2)]
                if idx:
                    answers.append(c.commit("p", ["y"], warehouse=op[2] % 3, indexes=idx).tolist())
            elif op[0] == "get" and size:
                _, who, n, groups, both = op
                r = c.acquire("p", who, ["x", "y"] if both else ["x"], n * gs if groups else n, groups=groups,
                              allow_partial=True)
                answers.append(None if r is None else (r.indexes.tolist(), r.locations.tolist()))
                if r is not None:
                    leases.append(r.lease)
            elif op[0] == "end" and leases:
                lease = leases.pop(op[1] % len(leases))
                answers.append(c.confirm(lease) if op[2] else c.release(lease) is not None)
        part = c.partitions.get("p")
        state = None if part is None else (
            part.ready[: part.size].tolist(), {k: v[: part.size].tolist() for k, v in part.loc.items()},
            {name: (cons.state[: part.size].tolist(), cons.taken, cons.leased,
                    {key: (np.flatnonzero(s.eligible.bits).tolist(), s.eligible.blocks.tolist(), s.eligible.total)
                     for key, s in cons.subs.items()})
             for name, cons in part.consumers.items()})
        return answers, state
    finally:
        partition.FEW = eligible.FEW = saved


@settings(max_examples=80, deadline=None)
@given(
    gs=st.sampled_from([1, 3]),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("put"), st.integers(1, 12)),
            st.tuples(st.just("col"), st.integers(0, 100), st.integers(1, 12)),
            st.tuples(st.just("get"), st.sampled_from("ab"), st.integers(1, 10), st.booleans(), st.booleans()),
            st.tuples(st.just("end"), st.integers(0, 5), st.booleans()),
        ),
        max_size=50,
    ),
)
def test_few_sample_paths_answer_and_leave_the_state_as_the_array_paths_do(ops, gs):
    """Commits, eligibility updates and locations of a few samples go one sample at a time (FEW);
    the same operations with those paths off (FEW = 0) must answer the same and leave the same state."""
    assert _replay(ops, gs, few=8) == _replay(ops, gs, few=0)


# -- per-consumer memory: views kept per consumer, and the dock-wide bound ---------------------------
def _held(c: Controller) -> int:
    return sum(p.cells_held() for p in c.partitions.values())


def test_a_consumer_keeps_its_most_recent_column_sets_and_rebuilds_the_others():
    from dockd.controller.partition import MAX_VIEWS

    c = Controller()
    cols = [f"c{i}" for i in range(MAX_VIEWS + 4)]
    put(c, "p", cols, 64)
    got: list[int] = []
    for _ in range(3):  # every column set in turn, past the bound: views are dropped and built again
        for i in range(MAX_VIEWS + 4):
            r = c.acquire("p", "t", [cols[0], cols[i]] if i else [cols[0]], 1)
            got += r.indexes.tolist()
            c.confirm(r.lease)
        cons = c.partitions["p"].consumers["t"]
        assert len(cons.subs) == MAX_VIEWS
    assert sorted(got) == list(range(3 * (MAX_VIEWS + 4)))  # each sample once, in order, whichever view
    assert got == sorted(got)
    assert c.catalog.cells.used == _held(c) == c.partitions["p"].capacity * (1 + MAX_VIEWS)


def test_consumers_and_column_sets_stop_at_the_dock_bound_and_nothing_changes():
    from dockd.controller.partition import CELLS_PER_SAMPLE
    from dockd.errors import DockFull

    c = Controller(max_samples=4096)  # 16 bytes per sample: 64 KiB of per-consumer memory
    limit = CELLS_PER_SAMPLE * 4096
    assert c.catalog.cells.limit == limit
    put(c, "p", ["x", "y"], 2048)  # capacity 2048: each consumer 2 KiB, each of its views 2 KiB more
    made = 0
    with pytest.raises(DockFull, match="consumer name") as e:
        for i in range(100):
            c.acquire("p", f"eve{i}", ["x"], 1)
            made += 1
    assert "MiB" in str(e.value) and "--max-samples" in str(e.value)
    assert made == limit // (2 * 2048)  # a consumer and its one view each: 4 KiB
    assert f"eve{made}" not in c.partitions["p"].consumers  # the refused one left nothing
    assert c.catalog.cells.used == _held(c) <= limit
    assert c.acquire("p", "eve0", ["x"], 1).indexes.tolist() == [1]  # the others go on
    with pytest.raises(DockFull):
        c.acquire("p", "eve0", ["y"], 1)  # another view of an existing consumer is refused too
    with pytest.raises(DockFull, match="growing partition"):
        put(c, "p", ["x"], 1)  # a grown partition would double every consumer's state
    assert c.partitions["p"].size == 2048 and c.catalog.cells.used == _held(c)
    c.clear("p")
    assert c.catalog.cells.used == 0
    put(c, "q", ["x"], 8)
    assert c.acquire("q", "fresh", ["x"], 8).indexes.tolist() == list(range(8))


def test_a_journal_rebuilds_consumers_past_a_lower_bound(tmp_path):
    from dockd.controller.journal import Journal
    from dockd.errors import DockFull

    j = Journal(tmp_path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    core.create_partition("p")
    j.create("p", 1, [])
    core.commit("p", ["x"], warehouse=1, new_count=4096)
    j.commit("p", ["x"], 1, None, 4096, 1, 0, 0)
    for i in range(8):
        lease = core.book.leases[core.acquire("p", f"c{i}", ["x"], 1).lease]
        j.grant(lease, 30.0)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)  # (the default bound while loading)
    back.max_samples = 1024  # now lower than what it holds: kept, counted, and nothing more is taken
    assert len(back.partitions["p"].consumers) == 8 and len(back.leases) == 8
    assert back.catalog.cells.used == _held(back) > back.catalog.cells.limit
    with pytest.raises(DockFull):
        back.acquire("p", "c9", ["x"], 1)
    snap = Controller.restore(back.snapshot(0.0), wall_offset=0.0)
    assert snap.catalog.cells.used == _held(snap) > 0


def test_a_lease_keeps_its_own_indexes_not_the_scan_they_came_from():
    """An outstanding lease of one sample held the whole array its samples were picked from: up to 8 KiB
    of a block's scan, or every eligible sample of the partition for an order_by or where get (1.5 MB per
    lease on 200k samples). Its indexes are its own now."""
    c = Controller()
    n = 5000
    c.commit("p", ["x"], warehouse=0, new_count=n, tags={"age": list(range(n))[::-1]})
    got = [c.acquire("p", "a", ["x"], 1), c.acquire("p", "b", ["x"], 2, order_by="age"),
           c.acquire("p", "d", ["x"], 3, shuffle=True, seed=1), c.acquire("p", "e", ["x"], 2, where={"age": (0, 9)})]
    for r in got:
        lease = c.leases[r.lease]
        assert lease.indexes.base is None and lease.indexes.nbytes == 8 * len(lease.indexes)
    assert got[1].indexes.tolist() == [n - 1, n - 2] and got[3].indexes.tolist() == [n - 10, n - 9]


def test_outstanding_leases_are_bounded_across_the_dock(monkeypatch):
    from dockd import limits
    from dockd.errors import DockFull

    monkeypatch.setattr(limits, "MAX_OPEN_LEASES", 5)
    c = Controller()
    put(c, "p", ["x"], 16)
    held = [c.acquire("p", f"c{i % 2}", ["x"], 1, lease_timeout=7 * 86400, token=i + 1) for i in range(5)]
    with pytest.raises(DockFull, match="5 leases outstanding"):
        c.acquire("p", "c0", ["x"], 1)
    with pytest.raises(DockFull):
        c.share("p", "r", ["x"], 1, dp_rank=0, dp_size=2)
    assert c.acquire("p", "c0", ["x"], 1, token=3).lease == held[2].lease  # a retried get still gets its lease
    c.confirm(held[0].lease)
    assert c.acquire("p", "c0", ["x"], 1) is not None  # room again
    assert len(c.leases) == 5


def _few_paths_run(seed: int) -> list:
    """A random workload of small puts, gets, confirms and releases; what each step returned and the state after."""
    import random

    rng = random.Random(seed)
    counter = iter(range(1, 1 << 30))
    c = Controller(lease_ids=lambda: next(counter))
    c.create_partition("g", group_size=2)
    leases: list[int] = []
    out: list = []
    for _ in range(400):
        op = rng.random()
        part = rng.choice(["p", "g"])
        gs = 2 if part == "g" else 1
        if op < 0.3:
            out.append(("put", put(c, part, ["x"], gs * rng.randint(1, 4), gs=gs)))
        elif op < 0.65:
            n = rng.randint(1, 8) * gs
            try:
                r = c.acquire(part, rng.choice("ab"), ["x"], n, groups=gs > 1 and rng.random() < 0.5,
                              allow_partial=True)
            except DockValueError as e:
                out.append(("error", str(e)))
                continue
            out.append(("get", None if r is None else r.indexes.tolist()))
            if r is not None:
                leases.append(r.lease)
        elif leases:
            lid = leases.pop(rng.randrange(len(leases)))
            out.append(("confirm", c.confirm(lid)) if op < 0.85 else ("release", len(c.release(lid).indexes)))
    for name, p in c.partitions.items():
        for cname, cons in p.consumers.items():
            subs = {k: (s.eligible.bits.tolist(), s.eligible.blocks.tolist(), s.eligible.total)
                    for k, s in cons.subs.items()}
            out.append((name, cname, cons.state[:p.size].tolist(), cons.taken, cons.leased, subs))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_few_sample_paths_do_what_the_array_paths_do(monkeypatch, seed):
    """Small leases and commits take scalar paths (a numpy call on a tiny array costs more); with them
    switched off, the same workload must hand out the same samples and leave the same state."""
    from dockd.controller import core as cmod
    from dockd.controller import eligible as emod
    from dockd.controller import partition as pmod

    fast = _few_paths_run(seed)
    monkeypatch.setattr(pmod, "FEW", -1)
    monkeypatch.setattr(cmod, "FEW", -1)
    monkeypatch.setattr(emod, "FEW", -1)
    assert _few_paths_run(seed) == fast


def test_writer_tokens_survive_a_snapshot_so_a_put_re_sent_after_a_restart_is_applied_once():
    """A put's writer re-sends it with its token to another warehouse when the first went away after
    its commit: the controller answers it with the first attempt's indexes. The snapshot a restarted
    controller starts from kept no tokens, so such a re-send made new samples beside the first ones."""
    c = Controller()
    first = c.commit("p", ["x"], warehouse=1, new_count=3, token=77)
    c.commit("p", ["y"], warehouse=1, indexes=[0, 1], token=78)  # (explicit indexes: kept as they are)
    back = Controller.restore(c.snapshot(0.0), wall_offset=0.0)
    assert back.catalog.tokens.get(77) == ("p", ("x",), range(0, 3))
    assert back.catalog.tokens.get(78)[2].tolist() == [0, 1]
    again = back.commit("p", ["x"], warehouse=2, new_count=3, token=77)
    assert again.tolist() == first.tolist() and back.partitions["p"].size == 3
