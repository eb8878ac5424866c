"""The warehouse's shared-memory pool: segments are reused warm, but never while a reader maps them."""

from __future__ import annotations

import os

import pytest

from dockd.errors import DockNotFound, DockProtocolError
from dockd.net import memfd, same_host
from dockd.warehouse.segments import Segments, size_class

pytestmark = pytest.mark.skipif(not same_host.available(), reason="Linux shared memory only")


def test_a_cleared_segment_is_reused_only_once_every_reader_unpinned_it():
    pool = Segments(keep_bytes=1 << 30)
    a = pool.take(3 << 20)
    pool.lend(111, [a])
    pool.lend(222, [a])
    pool.release(a)                       # its partition was cleared, but two readers map it
    b = pool.take(3 << 20)
    assert b is not a                     # not handed out again under the readers
    pool.unpin(111, [a.sid])
    pool.unpin(111, [a.sid])              # unpinning twice what was lent once changes nothing
    assert pool.take(3 << 20) is not a
    pool.process_exited(222)              # the other reader's process ended: nobody maps it now
    c = pool.take(3 << 20)
    assert c is a and pool.reused == 1    # warm, same memory
    assert c.buffer.size == 3 << 20


def test_cleared_data_a_reader_still_maps_is_counted_until_it_is_unmapped():
    pool = Segments(keep_bytes=1 << 30)
    lent: list[int] = []
    pool.on_lent = lent.append
    a, b = pool.take(3 << 20), pool.take(1 << 20)
    pool.lend(111, [a, a])
    pool.release(b)                       # nobody maps it: back to the pool, nothing lent
    pool.release(a)
    pool.release(a)                       # (released twice: counted once)
    assert lent == [a.size]
    pool.unpin(111, [a.sid])
    assert lent == [a.size]               # one of its two descriptors is still mapped
    pool.process_exited(111)
    assert lent == [a.size, -a.size] and pool.take(3 << 20) is a
    pool.keep_count = 1  # past it, freed segments readers map are let go: still counted until unmapped
    c, d = pool.take(2 << 20), pool.take(2 << 20)
    pool.lend(222, [c, d])
    pool.release(c)
    pool.release(d)
    assert lent[2:] == [c.size, d.size]
    pool.unpin(222, [d.sid, c.sid])
    assert sorted(lent[4:]) == [-d.size, -c.size] and sum(lent) == 0


def test_segments_of_another_size_class_are_not_mixed_and_the_pool_is_bounded():
    pool = Segments(keep_bytes=8 << 20)
    small, big = pool.take(1 << 20), pool.take(6 << 20)
    assert size_class(1 << 20) != size_class(6 << 20)
    pool.release(small)
    pool.release(big)                     # over keep_bytes together: one of them is dropped
    assert pool.idle_bytes == size_class(1 << 20) + size_class(6 << 20)
    assert pool.take(6 << 20) is big and pool.take(1 << 20) is small
    pool.release(pool.take(20 << 20))     # past keep_bytes: closed, not kept
    assert pool.idle_bytes == 0


def test_staging_buffers_are_registered_once_and_must_not_shrink():
    pool = Segments(keep_bytes=0)
    fd = os.memfd_create("staging", memfd.MFD_FLAGS)
    os.ftruncate(fd, 1 << 20)
    with pytest.raises(DockProtocolError, match="sealed against shrinking"):
        pool.staging(7, 42, os.dup(fd), 100)
    memfd.seal(fd, memfd.STAGING_SEALS)
    view = pool.staging(7, 42, os.dup(fd), 100)
    os.pwrite(fd, b"hello", 0)
    assert bytes(pool.staging(7, 42, None, 5)[:5]) == b"hello" and view.flags.writeable is False
    with pytest.raises(DockNotFound, match="staging buffer 43"):
        pool.staging(7, 43, None, 5)
    with pytest.raises(DockProtocolError, match="from a"):
        pool.staging(7, 42, None, 2 << 20)
    pool.process_exited(7)
    with pytest.raises(DockNotFound):
        pool.staging(7, 42, None, 5)
    os.close(fd)
