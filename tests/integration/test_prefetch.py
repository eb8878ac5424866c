"""Leases taken ahead (get(prefetch=n)) against real daemons: one acquire per window, each get's
samples exactly once across the members of a consumer name, and the window given back when its
client closes, exits, dies or lets it grow old."""

from __future__ import annotations

import json

import pytest
import torch

import dockd
from dockd.errors import DockTimeout
from tests.conftest import wait_until


def leased(dock, partition: str, consumer: str = "train") -> int:
    return dock.stats()["partitions"][partition]["consumers"].get(consumer, {}).get("leased", 0)


def test_a_window_is_one_acquire_and_two_members_share_the_stream_exactly_once(cluster, partition):
    with dockd.connect(cluster.address) as a, dockd.connect(cluster.address) as b:
        a.put({"x": torch.arange(48)}, partition=partition)
        first = a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4)
        assert first.indexes == [0, 1] and [int(v) for v in first["x"]] == [0, 1]
        assert leased(a, partition) == 6  # the 3 gets held ahead are leased to `a`, not offered to `b`
        got = [first.indexes, b.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes]
        assert got[1] == [8, 9]
        for k in range(16):
            dock = (a, b)[k % 2]
            batch = dock.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4)
            assert [int(v) for v in batch["x"]] == batch.indexes  # each get's own values
            got.append(batch.indexes)
        everything = [i for idx in got for i in idx]
        assert len(everything) == len(set(everything)) == 36  # each sample once
        a.stats()  # (each member's stats call delivers its pending confirms first)
        assert leased(b, partition) == 12  # each member's last window holds 3 gets' worth
        a.close()
        b.close()
        with dockd.connect(cluster.address) as c:  # ... which their close gave back
            rest = c.get("train", ["x"], 12, partition=partition, timeout=5).indexes
        assert sorted(everything + rest) == list(range(48))


def test_close_releases_the_window_at_once(cluster, partition):
    with dockd.connect(cluster.address) as b:
        b.put({"x": torch.arange(8)}, partition=partition)
        a = dockd.connect(cluster.address)
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [0, 1]
        assert leased(a, partition) == 6  # (a's stats: its get's confirm goes first)
        a.close()
        # (the daemon's lease timeout is 120 s: these come back because a's close gave them back)
        assert b.get("train", ["x"], 6, partition=partition, timeout=5).indexes == [2, 3, 4, 5, 6, 7]


CHILD = """
import json, os, sys, dockd
d = dockd.connect(sys.argv[1])
got = [d.get("train", ["x"], 2, partition=sys.argv[2], timeout=10, prefetch=4).indexes for _ in range(2)]
d.stats()  # (a controller call delivers the pending confirms of the gets first)
print(json.dumps(sum(got, [])), flush=True)
if sys.argv[3] == "kill":
    os.kill(os.getpid(), 9)
# "exit": leaves without close(), the Dock still open
"""


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_member_that_dies_or_exits_holding_a_window_loses_nothing(cluster, partition, client, how):
    with dockd.connect(cluster.address) as b:
        b.put({"x": torch.arange(16)}, partition=partition)
        out = client(CHILD, cluster.address, partition, how, check=False)
        assert out.returncode == (-9 if how == "kill" else 0), out.stderr
        served = json.loads(out.stdout)
        assert served == [0, 1, 2, 3]
        # the child's window (4..7) comes back when its connections close (killed) or as it exits;
        # the samples its gets returned were confirmed and never come again
        rest = b.get("train", ["x"], 12, partition=partition, timeout=10).indexes
        assert sorted(rest) == list(range(4, 16))


def test_a_window_whose_leases_expire_is_not_served(partition):
    with dockd.start_local(1, lease_timeout=1.0) as c, dockd.connect(c.address) as a, \
            dockd.connect(c.address) as b:
        a.put({"x": torch.arange(12)}, partition=partition)
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [0, 1]
        wait_until(lambda: leased(b, partition) == 0, timeout=10, what="the window's leases to expire")
        taken = b.get("train", ["x"], 6, partition=partition, timeout=5).indexes
        assert taken == [2, 3, 4, 5, 6, 7]  # handed out again, to `b`
        # `a` serves nothing from its expired window: its next gets take what is left
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [8, 9]
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [10, 11]


def test_a_full_get_takes_ahead_only_what_is_ready_and_gives_back_a_short_tail(cluster, partition):
    with dockd.connect(cluster.address) as a, dockd.connect(cluster.address) as b:
        a.put({"x": torch.arange(5)}, partition=partition)
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [0, 1]
        assert leased(a, partition) == 2  # [2, 3] held ahead; [4] (less than a get) given back
        assert b.get("train", ["x"], 1, partition=partition, timeout=5).indexes == [4]
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [2, 3]
        with pytest.raises(DockTimeout):  # none ready: waits as a get without prefetch, then says so
            a.get("train", ["x"], 2, partition=partition, timeout=0.3, prefetch=4)
        a.put({"x": torch.arange(5, 7)}, partition=partition)
        assert a.get("train", ["x"], 2, partition=partition, timeout=5, prefetch=4).indexes == [5, 6]


def test_a_short_window_is_served_in_the_leases_the_controller_granted(cluster, partition):
    """9 ready, gets of 4 ahead: the controller grants leases of 4, 4 and 1, and each get hands out just
    its lease's samples (a cut of the client's own, 3 + 3 + 3, confirmed sample 3 twice and lost 6 and 7
    once the window's last lease was given back)."""
    with dockd.connect(cluster.address) as a, dockd.connect(cluster.address) as b:
        a.put({"x": torch.arange(9)}, partition=partition)
        got = [a.get("train", ["x"], 4, partition=partition, timeout=5, prefetch=4, allow_partial=True)
               for _ in range(2)]
        assert [g.indexes for g in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert all([int(v) for v in g["x"]] == g.indexes for g in got)
        a.close()  # (gives back the window's last lease, [8])
        assert b.get("train", ["x"], 9, partition=partition, timeout=5, allow_partial=True).indexes == [8]


def test_groups_stay_whole_with_prefetch(cluster, dock, partition):
    dock.put({"x": torch.arange(24)}, partition=partition, group_size=4)
    got = [dock.get("g", ["x"], 4, partition=partition, groups=True, timeout=5, prefetch=3).indexes for _ in range(6)]
    assert got == [list(range(k, k + 4)) for k in range(0, 24, 4)]


def test_rank_aware_gets_keep_their_shares_with_prefetch(cluster, partition):
    with dockd.connect(cluster.address) as r0, dockd.connect(cluster.address) as r1:
        r0.put({"x": torch.arange(8), "n": [1.0, 9.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0]}, partition=partition)
        a = r0.get("t", ["x", "n"], 2, partition=partition, dp_rank=0, dp_size=2, balance_by="n", timeout=5, prefetch=4)
        b = r1.get("t", ["x", "n"], 2, partition=partition, dp_rank=1, dp_size=2, balance_by="n", timeout=5, prefetch=4)
        assert a.step == b.step == 0
        assert sorted(a.indexes + b.indexes) == [0, 1, 2, 3]  # one step's global batch, split
        assert sum(a["n"]) == sum(b["n"]) == 10.0  # balanced: one 9 and one 1 each


def test_prefetch_is_checked(dock, partition):
    with pytest.raises(dockd.DockValueError, match="prefetch"):
        dock.get("c", ["x"], 1, partition=partition, prefetch=-1)


def test_a_retried_acquire_gets_back_every_lease_of_its_window(cluster, dock, partition, raw):
    """The reply of an acquire taking leases ahead (per_lease) is lost and the client re-sends it with
    the same token: it gets all the leases of that grant again, not only the first (the others would
    stay leased to it, unseen, until they expired), and nothing more is leased."""
    from dockd._proto import dockd_pb2 as pb

    dock.put({"x": torch.arange(6)}, partition=partition)
    c = raw(cluster.address, session=b"retrying-client")
    req = pb.AcquireRequest(partition=partition, consumer="train", columns=["x"], count=6, per_lease=2,
                            allow_partial=True, token=4242, timeout=10)
    first = c.call(pb.Frame(id=1, acquire=req)).acquire_reply
    again = c.call(pb.Frame(id=2, acquire=req)).acquire_reply
    assert len(first.leases) == 3 and list(first.indexes) == list(range(6))
    assert (list(again.leases), list(again.indexes), again.lease) == (list(first.leases), list(first.indexes),
                                                                     first.lease)
    assert leased(dock, partition) == 6
    c.send(pb.Frame(id=3, release=pb.ReleaseRequest(leases=list(again.leases))))
    wait_until(lambda: leased(dock, partition) == 0, what="the retried window released whole")
