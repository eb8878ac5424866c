"""Warehouse membership and the journal, driven directly (no daemons): a warehouse that
drops its connection is probed, waited for, and either rejoins or is declared lost;
a controller rebuilt from its state dir is the controller that was lost."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller.core import LOST_WAREHOUSE, Controller, Inventory
from dockd.controller.journal import Journal
from dockd.controller.membership import Membership
from dockd.errors import DockAuthError, DockDataLost, DockTimeout
from tests.unit.controller.fakes import FakePeer


def reg(port: int, instance: int, **kw) -> pb.RegisterWarehouse:
    return pb.RegisterWarehouse(host="127.0.0.1", port=port, capacity=1 << 20, instance=instance, **kw)


def no_commit(c):  # registrations without pending commits never call it
    raise AssertionError("unexpected commit")


def run(coro):
    return asyncio.run(coro)


def test_a_dropped_warehouse_whose_port_refuses_is_lost_at_once():
    async def main():
        core = Controller()
        changes = []
        m = Membership(core, None, grace=30.0, on_change=lambda: changes.append(1))
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        peer = FakePeer()
        wid = m.register(peer, reg(port, 7), no_commit).id
        core.commit("p", ["x"], warehouse=wid, new_count=2)
        m.connection_lost(peer)
        assert m.get(wid).state == "rejoining"
        for _ in range(100):
            await asyncio.sleep(0.02)
            if m.get(wid).state == "lost":
                break
        assert m.get(wid).state == "lost" and changes
        with pytest.raises(DockDataLost):
            core.acquire("p", "c", ["x"], 2)
        m.close()

    run(main())


def test_a_probe_that_cannot_tell_is_made_again_and_a_refusal_then_retires_at_once():
    """A killed warehouse's address may take the probe's connection and reset it (the probe cannot
    tell) before it refuses connections: the probe is made again after 0.05, 0.2 and 1 s, and the
    first refusal retires it (it stayed `rejoining` for the whole grace, its samples offered to gets)."""
    async def main():
        now = [100.0]
        answers = [None, None, 0]
        probed = []

        async def probe(host, port):
            probed.append(now[0])
            return answers.pop(0)

        m = Membership(Controller(), None, grace=30.0, on_change=lambda: None, clock=lambda: now[0], probe=probe)

        async def advance(seconds):
            now[0] += seconds
            m.timers.run_due()
            for _ in range(3):
                await asyncio.sleep(0)

        try:
            a = FakePeer()
            wid = m.register(a, reg(7001, 7), no_commit).id
            m.connection_lost(a)
            await advance(0.0)
            assert probed == [100.0] and m.get(wid).state == "rejoining"
            await advance(0.05)
            assert len(probed) == 2 and m.get(wid).state == "rejoining"
            await advance(0.2)
            assert len(probed) == 3 and m.get(wid).state == "lost"
            await advance(5.0)
            assert len(probed) == 3  # (no probe after it was told)
        finally:
            m.close()

    run(main())


def test_a_silent_warehouse_gets_its_grace_then_is_lost_and_a_rejoin_in_time_keeps_it():
    async def main():
        now = [100.0]
        probed = []

        async def cannot_tell(host, port):  # (a silent address: the probe cannot tell who is there)
            probed.append(port)
            return None

        core = Controller()
        m = Membership(core, None, grace=30.0, on_change=lambda: None, clock=lambda: now[0], probe=cannot_tell)

        async def advance(seconds):
            now[0] += seconds
            m.timers.run_due()
            await asyncio.sleep(0)

        try:
            a, b = FakePeer(), FakePeer()
            wid = m.register(a, reg(7001, 7), no_commit).id
            m.connection_lost(a)
            await advance(29.0)
            assert m.get(wid).state == "rejoining" and probed == [7001]
            # back within the grace, same process: same id, still a member
            again = m.register(b, reg(7001, 7, rejoin=True, id=wid), no_commit)
            assert again.id == wid and m.get(wid).state == "joined"
            await advance(10.0)  # (the grace it had would have run out by now: it no longer counts)
            assert m.get(wid).state == "joined"
            m.connection_lost(b)
            await advance(29.0)
            assert m.get(wid).state == "rejoining"
            await advance(1.5)
            assert m.get(wid).state == "lost"
        finally:
            m.close()

    run(main())


class ClosedPeer(FakePeer):
    def __init__(self) -> None:
        super().__init__("warehouse")
        self.closed = True


async def answering_as(instance: int):
    """A listener at a free port that opens every connection with a challenge naming `instance`."""
    from dockd.net import wire

    async def greet(reader, writer):
        writer.write(wire.header(pb.Frame(challenge=pb.Challenge(instance=instance)), 0))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_new_process_at_a_known_address_replaces_the_old_one_once_it_answers_there():
    async def main():
        core = Controller()
        m = Membership(core, None, grace=30.0, on_change=lambda: None)
        server, port = await answering_as(2)  # the new process listens at the old one's address
        try:
            old_peer = FakePeer()
            old = m.register(old_peer, reg(port, 1), no_commit).id
            core.commit("p", ["x"], warehouse=old, new_count=2)
            # the old process's connection is still open: nobody takes its place, whatever it claims
            with pytest.raises(DockAuthError, match="live member"):
                m.register(FakePeer(), reg(port, 2), no_commit)
            with pytest.raises(DockAuthError, match="another address"):
                m.register(FakePeer(), reg(port + 1, 1, rejoin=True, id=old), no_commit)
            assert m.get(old).state == "joined" and core.acquire("p", "c", ["x"], 1).indexes.tolist() == [0]
            m.connection_lost(old_peer)  # it died; the new process registers (perhaps before the probe is back)
            for _ in range(100):
                try:
                    new = m.register(FakePeer(), reg(port, 2), no_commit).id
                    break
                except DockTimeout:  # the controller checks who answers at the address: the link retries
                    await asyncio.sleep(0.02)
            assert new != old and m.get(old).state == "lost" and m.get(new).state == "joined"
        finally:
            server.close()
            m.close()

    run(main())


def test_a_registration_is_refused_while_the_member_at_its_address_answers_there():
    async def main():
        m = Membership(Controller(), None, grace=30.0, on_change=lambda: None)
        server, port = await answering_as(1)  # the member itself still answers at its address
        try:
            old = m.register(ClosedPeer(), reg(port, 1), no_commit).id  # its connection dropped (a network blip)
            m.get(old).state = "rejoining"
            for _ in range(100):
                try:
                    m.register(FakePeer(), reg(port, 2), no_commit)
                except DockTimeout:
                    await asyncio.sleep(0.02)
                    continue
                except DockAuthError as e:
                    assert "the member itself answers there" in str(e)
                    break
                raise AssertionError("an impostor took a live member's address")
            assert m.get(old).state == "rejoining"
            # the member itself comes back on a new connection: the usual rejoin
            assert m.register(FakePeer(), reg(port, 1, rejoin=True, id=old), no_commit).id == old
            assert m.get(old).state == "joined"
        finally:
            server.close()
            m.close()

    run(main())


def test_rejoin_marks_what_a_known_warehouse_no_longer_holds_as_lost():
    c = Controller()
    c.commit("p", ["x", "y"], warehouse=3, new_count=6)
    inv = {"p": Inventory(1, 10, {"x": np.arange(6), "y": np.array([0, 1, 2])}), "gone": Inventory(1, 5, {"x": np.arange(2)})}
    drop = c.rejoin(3, inv, known=True)
    assert drop == ["gone"]  # the dock cleared it while the warehouse was away
    assert c.partitions["p"].loc["y"][:6].tolist() == [3, 3, 3, LOST_WAREHOUSE, LOST_WAREHOUSE, LOST_WAREHOUSE]
    assert c.acquire("p", "a", ["x", "y"], 3).indexes.tolist() == [0, 1, 2]
    with pytest.raises(DockDataLost) as e:
        c.acquire("p", "a", ["x", "y"], 3)
    assert e.value.indexes == [3, 4, 5] and e.value.columns == ["y"]


def test_rejoin_without_records_rebuilds_partitions_and_keeps_newer_writes():
    c = Controller()
    c.rejoin(1, {"p": Inventory(2, 64, {"x": np.arange(0, 4), "y": np.arange(0, 2)})}, known=False)
    c.rejoin(2, {"p": Inventory(2, 64, {"x": np.arange(4, 8)})}, known=False)
    part = c.partitions["p"]
    assert part.recovered and part.size == 8 and part.group_size == 2
    assert part.loc["x"][:8].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert c.acquire("p", "a", ["x"], 8).indexes.tolist() == list(range(8))
    # index 0 of column x was written again meanwhile on warehouse 1: a late copy on warehouse 3 is ignored
    c.rejoin(3, {"p": Inventory(2, 64, {"x": np.arange(0, 2)})}, known=False)
    assert part.loc["x"][:2].tolist() == [1, 1]
    assert c.commit("p", ["x"], warehouse=1, new_count=2, group_size=2).tolist() == [8, 9]


def test_a_re_sent_commit_is_applied_once():
    c = Controller()
    first = c.commit("p", ["x"], warehouse=1, new_count=3, put_id=5)
    again = c.commit("p", ["x"], warehouse=1, new_count=3, put_id=5)
    assert first.tolist() == again.tolist() == [0, 1, 2] and c.partitions["p"].size == 3
    assert c.commit("p", ["y"], warehouse=1, indexes=[0, 1], put_id=6).tolist() == [0, 1]
    assert c.commit("p", ["y"], warehouse=1, indexes=[0, 1], put_id=6).tolist() == [0, 1]  # not "already written"


def test_commits_of_new_samples_are_remembered_without_memory_per_sample():
    """The last commits are remembered for their re-sends (by put id, and by the writer's token): those of
    new samples as ranges, 8 bytes per sample before (a dock of large puts held 16,384 puts' worth)."""
    c = Controller()
    for k in range(50):
        c.commit("p", ["x"], warehouse=1, new_count=1000, put_id=k + 1, token=100 + k)
    c.commit("p", ["y"], warehouse=1, indexes=[5, 3, 9], put_id=99, token=999)
    kept = [*c.catalog.put_keys[1].values(), *(t[2] for t in c.catalog.tokens.values())]
    assert sum(isinstance(k, range) for k in kept) == 100 and sum(isinstance(k, np.ndarray) for k in kept) == 2
    again = c.commit("p", ["x"], warehouse=1, new_count=1000, put_id=7)
    assert isinstance(again, np.ndarray) and again.tolist() == list(range(6000, 7000))
    assert c.commit("p", ["y"], warehouse=1, indexes=[5, 3, 9], put_id=99).tolist() == [5, 3, 9]
    assert c.catalog.stored("p", 107).tolist() == list(range(7000, 8000))  # (by token: held, so answered)
    assert c.partitions["p"].size == 50_000


def test_a_retried_acquire_gets_the_same_lease():
    c = Controller()
    c.commit("p", ["x"], warehouse=0, new_count=4)
    a = c.acquire("p", "t", ["x"], 2, token=99)
    b = c.acquire("p", "t", ["x"], 2, token=99)
    assert a.lease == b.lease and a.indexes.tolist() == b.indexes.tolist() == [0, 1]
    assert c.acquire("p", "t", ["x"], 2, token=100).indexes.tolist() == [2, 3]
    c.confirm(a.lease)
    assert c.acquire("p", "t", ["x"], 2, token=99) is None  # the lease ended: a new acquire, nothing left


def _busy_controller(journal: Journal, now: float) -> Controller:
    core, _ = journal.load(lease_timeout=60, now=now)
    core.book.lease_ids = iter(range(1, 100)).__next__  # lease ids are random; these tests name them
    idx = core.commit("p", ["x"], warehouse=1, new_count=6, group_size=2, nbytes=100, put_id=1)
    journal.commit("p", ["x"], 1, None, 6, 2, 100, 1)
    core.commit("p", ["y"], warehouse=2, indexes=idx, nbytes=50, put_id=1)
    journal.commit("p", ["y"], 2, idx, 0, 2, 50, 1)
    for consumer, token in (("a", 11), ("b", 12)):
        res = core.acquire("p", consumer, ["x", "y"], 2, now=now, token=token, owner=consumer.encode())
        journal.grant(core.leases[res.lease], 1e12)
    journal.confirm([1])
    core.confirm(1)
    return core


def test_the_journal_rebuilds_the_controller_it_recorded(tmp_path):
    j = Journal(tmp_path)
    core = _busy_controller(j, now=100.0)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=5.0)  # another process, another clock
    for k in ("samples", "columns", "group_size"):
        assert back.stats()[0][k] == core.stats()[0][k]
    progress = {c: (s["taken"], s["leased"]) for c, s in back.stats()[0]["consumers"].items()}
    assert progress == {"a": (2, 0), "b": (0, 2)}  # ("ready" is known again once a consumer asks)
    assert list(back.leases) == [2] and back.leases[2].token == 12 and back.leases[2].owner == b"b"
    assert back.acquire("p", "b", ["x", "y"], 2, token=12).lease == 2  # the outstanding lease, found by its token
    assert back.acquire("p", "a", ["x", "y"], 4).indexes.tolist() == [2, 3, 4, 5]
    assert back.commit("p", ["x"], warehouse=1, new_count=2, group_size=2, put_id=1).tolist() == [0, 1, 2, 3, 4, 5]


def test_a_torn_last_record_is_cut_and_a_snapshot_replaces_the_journal(tmp_path):
    j = Journal(tmp_path, compact_bytes=1)
    _busy_controller(j, now=0.0)
    j.close()
    log = next(tmp_path.glob("journal-*.log"))
    log.write_bytes(log.read_bytes() + b"\x10\x00\x00\x00garbage")  # killed mid-write
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.stats()[0]["consumers"]["a"]["taken"] == 2
    names = sorted(f.name for f in tmp_path.iterdir())
    assert len([n for n in names if n.startswith("snapshot-")]) == 1  # older generations are gone
    again, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)  # from the snapshot alone
    assert again.stats() == back.stats()
