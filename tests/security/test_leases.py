"""A lease belongs to the client that took it (finding 2), and delivery is reported, not
silent (finding 6): ids cannot be guessed, another client's confirm or release is
refused unless the lease was handed over with its ticket, a confirm after expiry
raises, and a lease can be held longer while a consumer works on it."""

from __future__ import annotations

import pickle
import time

import pytest
import torch

import dockd
from dockd._proto import dockd_pb2 as pb

pytestmark = pytest.mark.timeout(180)


def test_lease_ids_are_not_guessable_and_other_clients_cannot_end_them(cluster, dock, partition, raw):
    dock.put({"x": torch.arange(8)}, partition=partition)
    a = dock.acquire("c", ["x"], 4, partition=partition, timeout=10)
    b = dock.acquire("c", ["x"], 4, partition=partition, timeout=10)
    assert abs(a.id - b.id) > 1 << 20 and min(a.id, b.id) > 1 << 20  # random 62-bit ids, not a counter
    with dockd.connect(cluster.address) as other:
        with pytest.raises(dockd.DockLeaseError, match="belongs to another client"):
            other.confirm(dockd.Lease(a.id, partition, ["x"], a.indexes, a.locations))
        with pytest.raises(dockd.DockLeaseError, match="belongs to another client"):
            other.release(dockd.Lease(b.id, partition, ["x"], b.indexes, b.locations))
    # the attack of the review: confirm ids 1..5000, one-way, from a plain connection
    c = raw(cluster.address)
    c.send(pb.Frame(id=1, oneway=True, confirm=pb.ConfirmRequest(leases=list(range(1, 5001)))))
    reply = c.call(pb.Frame(id=2, confirm=pb.ConfirmRequest(leases=[a.id, b.id])))
    assert sorted(reply.confirm_reply.refused) == sorted([a.id, b.id])
    stats = dock.stats()["partitions"][partition]["consumers"]["c"]
    assert (stats["taken"], stats["leased"]) == (0, 8)  # untouched
    dock.confirm(a)
    assert dock.release(b) == 4
    assert dock.get("c", ["x"], 4, partition=partition, timeout=10).indexes == b.indexes


def test_a_lease_handed_over_with_its_ticket_can_be_confirmed_elsewhere(cluster, dock, partition, client):
    dock.put({"x": torch.arange(4)}, partition=partition)
    lease = dock.acquire("c", ["x"], 4, partition=partition, timeout=10, inline=False)
    code = """
import pickle, sys, dockd
lease = pickle.loads(bytes.fromhex(sys.argv[2]))
with dockd.connect(sys.argv[1]) as d:
    values = d.fetch(lease)          # anyone may read the samples
    d.confirm(lease)                 # the ticket makes this process the lease's hand
    print([int(v) for v in values["x"]])
"""
    out = client(code, cluster.address, pickle.dumps(lease).hex())
    assert out.stdout.strip() == "[0, 1, 2, 3]"
    c = dock.stats()["partitions"][partition]["consumers"]["c"]
    assert (c["taken"], c["leased"]) == (4, 0)


def test_a_confirm_after_expiry_is_reported_and_leases_can_be_held_longer(partition):
    with dockd.start_local(1, lease_timeout=0.5) as c, dockd.connect(c.address) as d:
        d.put({"x": torch.arange(12)}, partition=partition)
        late = d.acquire("c", ["x"], 4, partition=partition, timeout=10)
        held = d.acquire("c", ["x"], 4, partition=partition, timeout=10, lease_timeout=60)
        kept = d.acquire("c", ["x"], 4, partition=partition, timeout=10)
        assert d.extend(kept, 60) == 60
        deadline = time.monotonic() + 30
        while d.stats()["partitions"][partition]["consumers"]["c"]["leased"] > 8:
            assert time.monotonic() < deadline, "the short lease never expired"
            time.sleep(0.05)
        with pytest.raises(dockd.DockLeaseError, match="expired or was released"):
            d.confirm(late)
        with pytest.raises(dockd.DockLeaseError, match="expired or was released"):
            d.extend(late)
        d.confirm(held)  # still ours after the default timeout passed
        d.confirm(kept)
        again = d.get("c", ["x"], 4, partition=partition, timeout=10)  # only the expired ones come back
        assert again.indexes == late.indexes


def test_a_lease_of_a_client_that_dies_returns_at_once_even_when_held_longer(cluster, dock, partition, client):
    dock.put({"x": torch.arange(4)}, partition=partition)
    code = """
import os, sys, dockd
d = dockd.connect(sys.argv[1])
d.acquire("c", ["x"], 4, partition=sys.argv[2], timeout=10, lease_timeout=3600)
os.kill(os.getpid(), 9)
"""
    out = client(code, cluster.address, partition, check=False)
    assert out.returncode == -9
    assert dock.get("c", ["x"], 4, partition=partition, timeout=10).indexes == [0, 1, 2, 3]


def test_a_connection_without_a_session_cannot_have_its_session_claimed(raw):
    """Finding 10 of the second review: a raw client's implicit session was "conn:N", which any other
    client could claim at its handshake and so keep the first one's leases alive after it died."""
    from tests.conftest import serving

    with (serving("--controller", "--port", "0") as (address, _),
          dockd.connect(address) as d):  # connection ids count from 1
        d.put({"x": torch.arange(2)}, partition="p")
        a = raw(address)
        reply = a.call(pb.Frame(id=1, acquire=pb.AcquireRequest(partition="p", consumer="c", columns=["x"],
                                                               count=2, timeout=5, inline=False)))
        assert reply.acquire_reply.lease, reply
        claims = [raw(address, session=b"conn:%d" % n) for n in range(1, 24)]
        for k, c in enumerate(claims):  # a claimed session joins the controller's book at a first request
            assert c.call(pb.Frame(id=2 + k, stats=pb.StatsRequest())).WhichOneof("kind") == "stats_reply"
        a.close()  # the holder dies: its lease goes back to the pool at once, whoever claimed "conn:N"
        assert d.get("c", ["x"], 2, partition="p", timeout=10).indexes == [0, 1]
