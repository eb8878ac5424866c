"""A same-host client may keep the mapping of a segment whose values are gone (`dockd.net.reply_maps`): only
one none of whose pages was written, never for two replies at once, its segment unpinned all the same; a
segment passed again is mapped from it, and shows what the segment holds now. What a process keeps stays within
its budget (DOCKD_KEEP_MAPPINGS, 64 MiB by default), over all its transports, and goes when unused for a while,
when its transport closes or is collected; DOCKD_KEEP_MAPPINGS=0 keeps none."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.config import ClientConfig
from dockd.errors import DockValueError
from dockd.net import memfd, reply_maps, same_host
from dockd.net.reply_maps import ReplyMaps
from dockd.net.transport import Context, Endpoint, Reply
from tests.conftest import wait_until

pytestmark = pytest.mark.skipif(not same_host.available(), reason="needs memfd and SCM_RIGHTS (Linux)")

SIZE = 1 << 20


def maps_of(seg: memfd.Segment) -> int:
    """This process's mappings of `seg` (its own shared one included)."""
    ino = os.fstat(seg.fd).st_ino
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if len(parts := line.split()) > 4 and parts[4] == str(ino))


def shm(config: ClientConfig) -> same_host.ShmTransport:
    return same_host.ShmTransport(Endpoint("127.0.0.1", 1, unix="x"), Context(config=config))


@pytest.fixture
def transport():
    t = shm(ClientConfig(keep_mappings=4 * SIZE))
    yield t
    t.close()


def lend(t: same_host.ShmTransport, seg: memfd.Segment, offset: int = 0, nbytes: int = SIZE) -> list:
    """The values of a reply that passes `seg` (bytes [offset, offset + nbytes) as one uint8 tensor)."""
    col = pb.ColumnData(name="x", runs=[pb.Run(kind=pb.TENSOR, count=1, dtype="uint8", shape=[nbytes],
                                               offset=offset, nbytes=nbytes, segment=1)])
    reply = Reply(pb.Frame(pins=[seg.sid]), np.empty(0, dtype=np.uint8), [os.dup(seg.fd)])
    return codec.decode_reply([col], t.buffers([col], reply))[0]


def test_an_unwritten_mapping_is_kept_unpinned_and_maps_the_segment_again_showing_what_it_holds_now(transport):
    seg = memfd.Segment.create(SIZE)
    seg.writable()[:4] = b"dock"
    values = lend(transport, seg)
    addr = values[0].data_ptr()
    assert bytes(values[0][:4].numpy()) == b"dock"
    del values
    transport.idle()
    assert maps_of(seg) == 2 and transport.take_unpins() == [seg.sid]  # kept, and its segment unpinned
    seg.writable()[:4] = b"next"  # the warehouse fills the unpinned segment again
    again = lend(transport, seg, 4096, 4096)
    assert again[0].data_ptr() == addr + 4096 and transport.maps.hits == 1
    whole = lend(transport, seg)  # the kept mapping is lent to one reply at a time: this one maps anew
    assert whole[0].data_ptr() != addr and bytes(whole[0][:4].numpy()) == b"next"
    assert transport.maps.misses == 2


def test_a_mapping_a_value_was_written_through_is_unmapped_not_kept(transport):
    seg = memfd.Segment.create(SIZE)
    seg.writable()[:4] = b"dock"
    values = lend(transport, seg)
    values[0][8192] = 7  # the caller's write: that page is copied, the segment keeps its byte
    assert seg.map[8192] == 0
    del values
    transport.idle()
    assert maps_of(seg) == 1 and transport.take_unpins() == [seg.sid] and transport.maps.written == 1
    again = lend(transport, seg)
    assert int(again[0][8192]) == 0 and bytes(again[0][:4].numpy()) == b"dock"


def test_kept_mappings_stay_within_their_budget_and_go_when_the_transport_closes(transport):
    segs = [memfd.Segment.create(SIZE) for _ in range(6)]
    for seg in segs:
        values = lend(transport, seg)
        assert maps_of(seg) == 2
        del values
        transport.idle()
    assert [maps_of(s) - 1 for s in segs] == [1, 1, 1, 1, 0, 0]  # (4 x SIZE kept: the ones past it were not)
    assert sorted(transport.take_unpins()) == sorted(s.sid for s in segs)
    for seg in segs:  # a second pass over the six: the four kept serve again, the two others are mapped anew
        values = lend(transport, seg)
        del values
        transport.idle()
    assert (transport.maps.hits, transport.maps.misses) == (4, 8)
    assert [maps_of(s) - 1 for s in segs] == [1, 1, 1, 1, 0, 0]
    transport.close()
    assert [maps_of(s) - 1 for s in segs] == [0] * 6


def test_no_budget_keeps_nothing():
    maps = ReplyMaps(0)
    seg = memfd.Segment.create(SIZE)
    assert maps.map(seg.fd, seg.sid, SIZE) is None


def test_a_segment_bigger_than_the_budget_or_runs_past_its_end_is_mapped_as_before(transport):
    big = memfd.Segment.create(8 * SIZE)
    assert transport.maps.map(big.fd, big.sid, SIZE) is None
    seg = memfd.Segment.create(SIZE)
    assert transport.maps.map(seg.fd, seg.sid, SIZE + 1) is None
    assert transport.maps.map(seg.fd, 0, SIZE) is None  # (no segment id: nothing to unpin it by)


def test_the_budget_is_the_processs_over_all_its_transports(transport):
    other = shm(ClientConfig(keep_mappings=4 * SIZE))
    segs = [memfd.Segment.create(SIZE) for _ in range(6)]
    try:
        for k, seg in enumerate(segs):
            values = lend(transport if k % 2 else other, seg)
            del values
            (transport if k % 2 else other).idle()
            assert reply_maps.kept_bytes() <= 4 * SIZE
        # (past the budget a mapping is not kept; what is kept stays: a consumer cycling through more
        # segments than it holds finds most of them kept on its next pass, where LRU found none)
        assert [maps_of(s) - 1 for s in segs] == [1, 1, 1, 1, 0, 0] and reply_maps.kept_bytes() == 4 * SIZE
    finally:
        other.close()
    assert [maps_of(s) - 1 for s in segs] == [0, 1, 0, 1, 0, 0] and reply_maps.kept_bytes() == 2 * SIZE


def test_a_collected_transport_lets_what_it_kept_go():
    t = shm(ClientConfig(keep_mappings=4 * SIZE))
    seg = memfd.Segment.create(SIZE)
    values = lend(t, seg)
    del values
    t.idle()
    assert maps_of(seg) == 2
    del t
    gc.collect()
    assert maps_of(seg) == 1 and reply_maps.kept_bytes() == 0


def test_a_kept_mapping_unused_for_a_while_goes(transport, monkeypatch):
    """(A consumer that stopped, or a segment the warehouse closed: its pages are not held on to.)"""
    monkeypatch.setattr(reply_maps, "KEEP_IDLE_S", 0.05)
    seg, used = memfd.Segment.create(SIZE), memfd.Segment.create(SIZE)
    for s in (seg, used):
        values = lend(transport, s)
        del values
    transport.idle()
    assert maps_of(seg) == 2 and maps_of(used) == 2
    wait_until(lambda: maps_of(seg) == 1 and maps_of(used) == 1, timeout=10, what="kept mappings unused to go")
    assert reply_maps.kept_bytes() == 0


def test_the_budget_comes_from_dockd_keep_mappings_64_mib_by_default(monkeypatch):
    monkeypatch.delenv("DOCKD_KEEP_MAPPINGS", raising=False)
    assert ClientConfig.from_env().keep_mappings == ClientConfig().keep_mappings == 64 << 20
    monkeypatch.setenv("DOCKD_KEEP_MAPPINGS", str(4 << 20))
    assert ClientConfig.from_env().keep_mappings == 4 << 20
    monkeypatch.setenv("DOCKD_KEEP_MAPPINGS", "nan")
    with pytest.raises(DockValueError, match="DOCKD_KEEP_MAPPINGS"):
        ClientConfig.from_env()


def test_dockd_keep_mappings_0_unmaps_every_mapping_once_its_values_are_gone(monkeypatch):
    monkeypatch.setenv("DOCKD_KEEP_MAPPINGS", "0")
    t = shm(ClientConfig.from_env())
    seg = memfd.Segment.create(SIZE)
    try:
        values = lend(t, seg)
        assert maps_of(seg) == 2
        del values
        t.idle()
        assert maps_of(seg) == 1 and t.take_unpins() == [seg.sid] and reply_maps.kept_bytes() == 0
    finally:
        t.close()


def _in_a_thread(fn) -> bool:
    """Whether `fn()` returned within 10 s (a thread that deadlocked is a daemon: it does not hold up the run)."""
    import threading

    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(10)
    return not t.is_alive()


def test_a_transport_collected_inside_the_lock_lets_go_without_waiting_for_it():
    """A transport's close or collection may run in a finalizer, inside an allocation its thread makes under
    the lock: letting go of what it kept waits for no lock (before: the thread deadlocked on the lock it held,
    and every same-host get of the process after it, as in a warehouse-kill test that hung)."""
    kept, seg = reply_maps._Kept(), memfd.Segment.create(SIZE)
    mm = memfd.map_whole_private(seg.fd, SIZE)
    ident = (1, 2, SIZE)
    with kept.lock:
        kept.put((7, seg.sid), ident, mm, 4 * SIZE)
    del mm
    assert maps_of(seg) == 2 and kept.bytes == SIZE

    def collected_under_the_lock() -> None:
        with kept.lock:
            kept.drop(7)  # (what the finalizer of owner 7 calls)

    assert _in_a_thread(collected_under_the_lock), "a drop inside the lock deadlocked"
    assert kept.take((8, 1)) is None  # (the lock's next holder)
    assert kept.bytes == 0 and not kept.maps and maps_of(seg) == 1
    kept.drop(9)  # (the lock free: at once)
    assert not kept.owners_gone


def test_a_closed_transports_release_in_a_finalizer_keeps_nothing_and_waits_for_no_lock():
    t = shm(ClientConfig(keep_mappings=4 * SIZE))
    seg = memfd.Segment.create(SIZE)
    values = lend(t, seg)
    t.close()

    def released_under_the_lock() -> None:
        nonlocal values
        with reply_maps._KEPT.lock:
            del values  # (its finalizer: `_release` on a closed transport)
            gc.collect()

    assert _in_a_thread(released_under_the_lock), "a release inside the lock deadlocked"
    assert maps_of(seg) == 1 and t.take_unpins() == [seg.sid]
