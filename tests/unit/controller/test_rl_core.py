"""RL semantics in the pure controller and warehouse (no sockets): rounds and shares, model-parallel
confirms, deletes and their frees, retirement, seal and drain, tags, and their journal records."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dockd import codec
from dockd.controller.core import LEASED, TAKEN, Controller, Round
from dockd.controller.journal import Journal
from dockd.errors import DockDrained, DockNotFound, DockValueError
from dockd.warehouse.core import Warehouse


def _core(n=16, group_size=1) -> Controller:
    c = Controller(lease_timeout=60)
    c.commit("p", ["x"], warehouse=1, new_count=n, group_size=group_size)
    return c


def test_shares_split_by_position_are_idempotent_and_advance_on_confirm():
    c = _core(16)
    shares = {r: c.share("p", "t", ["x"], 4, dp_rank=r, dp_size=2) for r in (1, 0)}
    assert shares[0].indexes.tolist() == [0, 1, 2, 3] and shares[1].indexes.tolist() == [4, 5, 6, 7]
    assert c.share("p", "t", ["x"], 4, dp_rank=1, dp_size=2).lease == shares[1].lease  # asked again: the same
    c.confirm(shares[1].lease)
    nxt = c.share("p", "t", ["x"], 4, dp_rank=1, dp_size=2)
    assert nxt.step == 1 and nxt.indexes.tolist() == [12, 13, 14, 15]  # step 1: 8..15, rank 1 the second half
    again = c.share("p", "t", ["x"], 4, dp_rank=1, dp_size=2, step=0)  # a finished step: seen again, no lease
    assert again.lease == 0 and again.indexes.tolist() == [4, 5, 6, 7]


def test_a_balanced_round_is_held_until_weighed_then_split():
    c = _core(8)
    rnd = c.share("p", "t", ["x"], 2, dp_rank=0, dp_size=4, balance=True)
    assert isinstance(rnd, Round) and len(rnd.indexes) == 8
    assert c.share("p", "t", ["x"], 2, dp_rank=1, dp_size=4, balance=True) is None  # being weighed
    assert c.ready_count("p", "other", ["x"], False) == 8  # (another consumer is not affected)
    w = np.array([8, 1, 7, 2, 6, 3, 5, 4], dtype=float)
    assert c.split_round(rnd, w)
    got = [c.share("p", "t", ["x"], 2, dp_rank=r, dp_size=4, balance=True) for r in range(4)]
    assert sorted(i for g in got for i in g.indexes.tolist()) == list(range(8))
    assert all(g.weights == [9.0] * 4 for g in got)


def test_dropping_a_round_gives_its_samples_back():
    c = _core(4)
    rnd = c.share("p", "t", ["x"], 2, dp_rank=0, dp_size=2, balance=True)
    c.drop_round(rnd)
    assert c.acquire("p", "t", ["x"], 4).indexes.tolist() == [0, 1, 2, 3]


def test_a_model_parallel_share_is_taken_once_every_reader_confirmed():
    c = _core(8)
    a = c.share("p", "t", ["x"], 4, dp_rank=0, dp_size=1, mp_rank=0, mp_size=2, owner=b"tp0")
    b = c.share("p", "t", ["x"], 4, dp_rank=0, dp_size=1, mp_rank=1, mp_size=2, owner=b"tp1")
    assert a.lease == b.lease and c.leases[a.lease].holders == {b"tp0": 0, b"tp1": 1}
    assert not c.confirm(a.lease, 0)
    assert c.partitions["p"].consumers["t"].state[0] == LEASED
    assert c.share("p", "t", ["x"], 4, dp_rank=0, dp_size=1, mp_rank=0, mp_size=2).step == 1  # tp0 moves on
    assert c.confirm(a.lease, 1)
    assert c.partitions["p"].consumers["t"].state[0] == TAKEN


def test_a_stalled_model_parallel_rank_confirms_a_share_whose_round_was_forgotten():
    # Data-parallel rank 0 runs more than ROUNDS_KEPT steps ahead of rank 1: the round of rank 1's first
    # share is forgotten, and its confirms must still take the share (they raised TypeError once).
    from dockd.controller.rounds import ROUNDS_KEPT

    steps = ROUNDS_KEPT + 5
    c = _core(2 * steps + 2)

    def share(dp, mp, step=None):
        return c.share("p", "t", ["x"], 1, dp_rank=dp, dp_size=2, mp_rank=mp, mp_size=2, owner=b"r%d%d" % (dp, mp),
                       step=step)

    late = [share(1, mp) for mp in (0, 1)]
    assert late[0].lease == late[1].lease and late[0].step == 0
    for _ in range(steps):
        ahead = [share(0, mp) for mp in (0, 1)]
        assert not c.confirm(ahead[0].lease, 0) and c.confirm(ahead[1].lease, 1)
    assert not c.confirm(late[0].lease, 0)
    assert c.confirm(late[1].lease, 1)
    assert c.partitions["p"].consumers["t"].state[late[0].indexes[0]] == TAKEN


def test_an_expired_share_is_replaced_from_the_pool():
    c = _core(8)
    s0 = c.share("p", "t", ["x"], 2, dp_rank=0, dp_size=2, now=0.0, lease_timeout=1.0)
    c.share("p", "t", ["x"], 2, dp_rank=1, dp_size=2, now=0.0, lease_timeout=100.0, owner=b"r1")  # claims its own
    assert [l.id for l in c.expire_leases(5.0)] == [s0.lease]
    fresh = c.share("p", "t", ["x"], 2, dp_rank=0, dp_size=2, now=5.0)
    assert fresh.step == 0 and fresh.indexes.tolist() == [0, 1]  # the same samples, back from the pool
    assert fresh.lease != s0.lease


def test_delete_queues_frees_per_warehouse_and_drains_a_sealed_partition():
    c = Controller(lease_timeout=60)
    idx = c.commit("p", ["x"], warehouse=1, new_count=4)
    c.commit("p", ["y"], warehouse=2, indexes=idx[:2])
    c.seal("p")
    with pytest.raises(DockValueError, match="sealed"):
        c.commit("p", ["x"], warehouse=1, new_count=1)
    assert c.acquire("p", "t", ["x", "y"], 4) is None  # 2 and 3 could still get "y"
    assert c.delete("p", [2, 3, 3]) == 2
    frees = c.take_frees()
    assert {w: a.tolist() for w, a in frees["p"].items()} == {1: [2, 3]}
    rest = c.acquire("p", "t", ["x", "y"], 4)
    assert rest.indexes.tolist() == [0, 1]  # the rest of a sealed partition
    assert c.acquire("p", "t", ["x", "y"], 1) is None  # (leased samples could come back)
    c.confirm(rest.lease)
    with pytest.raises(DockDrained):
        c.acquire("p", "t", ["x", "y"], 1)
    with pytest.raises(DockNotFound, match="deleted"):
        c.commit("p", ["z"], warehouse=1, indexes=[2])
    assert c.stats()[0]["deleted"] == 2


def test_retirement_deletes_what_every_named_consumer_took():
    c = _core(4)
    c.create_partition("p", retire=["a", "b"])
    c.confirm(c.acquire("p", "a", ["x"], 4).lease)
    assert not c.pending_frees
    c.confirm(c.acquire("p", "b", ["x"], 2).lease)
    assert c.take_frees()["p"][1].tolist() == [0, 1]
    assert c.acquire("p", "late", ["x"], 3) is None  # only 2 and 3 are left


def test_tags_filter_and_order_and_check_their_input():
    c = Controller(lease_timeout=60)
    c.commit("p", ["x"], warehouse=1, new_count=4, tags={"age": [2, 0, 1, 0]})
    assert c.acquire("p", "t", ["x"], 4, order_by="age").indexes.tolist() == [1, 3, 2, 0]
    assert c.acquire("p", "u", ["x"], 1, where={"age": (2, 9)}).indexes.tolist() == [0]
    with pytest.raises(DockValueError, match="one per sample"):
        c.set_tags("p", [0, 1], {"age": [1, 2, 3]})
    with pytest.raises(DockValueError, match="identifier"):
        c.set_tags("p", [0], {"not a name": [1]})


def test_the_journal_replays_partition_operations(tmp_path):
    j = Journal(tmp_path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    core.create_partition("p", group_size=2, retire=["a"])
    j.create("p", 2, ["a"])
    core.reserve("p", 4, group_size=2)
    j.reserve("p", 4, 2)
    idx = core.commit("p", ["x"], warehouse=1, indexes=[0, 1, 2, 3], group_size=2, tags={"age": [1]})
    j.commit("p", ["x"], 1, idx, 0, 2, 0, 0, {"age": [1]})
    core.set_tags("p", [3], {"age": [7]})
    j.tags("p", [3], {"age": [7]})
    core.delete("p", [0, 1])
    j.delete("p", [0, 1])
    core.seal("p")
    j.seal("p")
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    st = back.stats()[0]
    assert (st["deleted"], st["sealed"], st["retire_when_consumed_by"], st["tags"]) == (2, True, ["a"], ["age"])
    assert back.acquire("p", "t", ["x"], 2, order_by="-age").indexes.tolist() == [3, 2]
    snap = Controller.restore(back.snapshot(0.0), wall_offset=0.0)
    assert snap.stats() == back.stats()


@pytest.mark.parametrize("picked", [[5], [5, 6, 7], [7, 5], [4, 6, 5, 7], [1, 3, 4, 9], list(range(2, 10)), list(range(2, 11)),
                                    [9, 3, *range(10, 20)]])
@pytest.mark.parametrize("as_array", [False, True])
def test_the_journal_replays_leases_of_any_indexes(tmp_path, picked, as_array):
    """A lease's indexes are recorded as a range when consecutive and as raw int64 otherwise, by a
    scalar path for a few of them and numpy for more: both come back as the same lease."""
    j = Journal(tmp_path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    core.create_partition("p")
    j.create("p", 1, [])
    idx = core.commit("p", ["x"], warehouse=1, new_count=30)
    j.commit("p", ["x"], 1, None, 30, 1, 0, 0)
    assert idx.tolist() == list(range(30))
    lease = core.grant(7, "p", "c", np.array(picked) if as_array else picked, deadline=30.0, token=3, owner=b"o")
    lease.indexes = np.array(picked, dtype=np.int64) if as_array else list(picked)
    j.grant(lease, 30.0)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.leases[7].indexes.tolist() == picked
    rest = back.acquire("p", "c", ["x"], 30, allow_partial=True).indexes.tolist()
    assert sorted(rest) == sorted(set(range(30)) - set(picked))


def test_warehouse_frees_a_put_once_all_its_samples_are_deleted_and_measures_columns():
    w = Warehouse(1 << 20)
    body = codec.Body()
    cols = codec.encode_columns({"t": [torch.ones(n) for n in (3, 1, 2, 5)], "n": [3, 1, 2, 5],
                                 "f": torch.tensor([0.5, 1.5, 2.5, 3.5])}, body)
    buf = pa.py_buffer(b"".join(bytes(b) for b in body.buffers))
    assert w.reserve(buf.size)
    w.store("p", [0, 1, 2, 3], cols, buf, buf.size)
    assert w.measure("p", "t", [3, 0]).tolist() == [5.0, 3.0]
    assert w.measure("p", "n", [1, 2]).tolist() == [1.0, 2.0]
    assert w.measure("p", "f", [2]).tolist() == [2.5]
    assert w.free_samples("p", [0, 1]) == (0, [])  # half of the put: its memory stays
    assert w.used == buf.size
    freed, _ = w.free_samples("p", [2, 3, 3])
    assert freed == buf.size and w.used == 0


def test_an_imported_partition_maps_warehouses_and_is_journaled(tmp_path):
    c = Controller(lease_timeout=60)
    c.commit("p", ["x"], warehouse=3, new_count=4, tags={"age": [1, 2, 3, 4]})
    c.commit("p", ["y"], warehouse=5, indexes=[0, 1])
    c.confirm(c.acquire("p", "t", ["x"], 1).lease)
    c.acquire("p", "t", ["x"], 1)  # leased: not taken in an export
    exported = c.export_partition("p")
    other = Controller(lease_timeout=60)
    other.import_partition(exported, "q", {3: 0, 5: 0})
    assert other.locate("q", [0, 1], ["x", "y"]).tolist() == [[0, 0], [0, 0]]
    with pytest.raises(DockValueError, match="exists"):
        other.import_partition(exported, "q", {})
    assert other.acquire("q", "t", ["x"], 3).indexes.tolist() == [1, 2, 3]
    j = Journal(tmp_path)
    j.load(lease_timeout=60, now=0.0)
    j.loaded("q", other.export_partition("q"))
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.stats()[0]["tags"] == ["age"] and back.locate("q", [3], ["x"]).tolist() == [[0]]


def test_near_hands_out_the_warehouses_samples_first_then_the_oldest_others():
    c = Controller(lease_timeout=60)
    c.commit("p", ["x"], warehouse=1, new_count=200_000, nbytes=1)   # 0..199999 on warehouse 1
    c.commit("p", ["x"], warehouse=2, new_count=4, nbytes=1)         # 200000..200003 on warehouse 2
    assert c.acquire("p", "a", ["x"], 3, near=2).indexes.tolist() == [200000, 200001, 200002]
    assert c.acquire("p", "a", ["x"], 3, near=2).indexes.tolist() == [200003, 0, 1]  # local ran out
    assert c.acquire("p", "a", ["x"], 2).indexes.tolist() == [2, 3]  # without near: FIFO
    c.commit("q", ["x"], warehouse=1, new_count=4, nbytes=1)
    assert c.acquire("q", "a", ["x"], 2, near=2).indexes.tolist() == [0, 1]  # nothing on 2: FIFO


def test_rank_rounds_under_random_asks_confirms_and_expiries_hand_each_sample_out_once():
    """Ranks ask, re-ask, confirm, die (their shares expire) in random order: no sample is taken
    twice, a step's shares never overlap, and once every rank has confirmed everything the
    partition is drained with every sample taken exactly once."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        dp, count, n = int(rng.integers(2, 5)), int(rng.integers(1, 4)), 0
        c = Controller(lease_timeout=10)
        n = dp * count * int(rng.integers(3, 7))
        c.commit("p", ["x", "w"], warehouse=1, new_count=n, nbytes=1)
        balance = bool(rng.integers(0, 2))
        now, held, taken = 0.0, {}, []  # held: rank -> (lease id, step, indexes) not yet confirmed
        for _ in range(400):
            rank = int(rng.integers(0, dp))
            act = rng.random()
            now += 0.5
            if act < 0.15 and rank in held:  # the rank dies: its share expires
                now += 20
                c.expire_leases(now)
                held.clear()
                continue
            if act < 0.55 and rank in held:
                lid, step, idx = held.pop(rank)
                if c.confirm(lid):
                    taken.extend(idx)
                continue
            res = c.share("p", "t", ["x", "w"], count, dp_rank=rank, dp_size=dp, balance=balance, now=now,
                          owner=b"r%d" % rank)
            if isinstance(res, Round):
                c.split_round(res, np.asarray(rng.integers(1, 100, len(res.indexes)), dtype=float))
                res = c.share("p", "t", ["x", "w"], count, dp_rank=rank, dp_size=dp, balance=balance, now=now,
                              owner=b"r%d" % rank)
            if res is None or res.lease == 0:
                continue
            assert len(res.indexes) == count
            if rank in held:
                assert held[rank][0] == res.lease  # asked again: the same share
            held[rank] = (res.lease, res.step, res.indexes.tolist())
            for _key, rounds in c.rounds.items():
                for rnd in rounds.values():
                    live = [ix for r, ix in enumerate(rnd.share_idx)  # (an expired share's samples are free again)
                            if ix is not None and (rnd.done[r] or rnd.shares[r] in c.leases)]
                    if live:
                        flat = np.concatenate(live)
                        assert len(np.unique(flat)) == len(flat)
        for lid, _, idx in held.values():
            if c.confirm(lid):
                taken.extend(idx)
        assert len(taken) == len(set(taken)), seed  # nothing taken twice
        cons = c.partitions["p"].consumers["t"]
        assert cons.taken == len(taken)
        # the rest goes out to the ranks, each confirming at once, until all of it is taken
        for _ in range(10 * n):
            if cons.taken == n:
                break
            for rank in range(dp):
                res = c.share("p", "t", ["x", "w"], count, dp_rank=rank, dp_size=dp, now=now, owner=b"r%d" % rank)
                if isinstance(res, Round):
                    c.split_round(res, None)
                    res = c.share("p", "t", ["x", "w"], count, dp_rank=rank, dp_size=dp, now=now,
                                  owner=b"r%d" % rank)
                if res is not None and res.lease:
                    assert c.confirm(res.lease)
                    taken.extend(res.indexes.tolist())
        assert sorted(taken) == list(range(n)), seed
