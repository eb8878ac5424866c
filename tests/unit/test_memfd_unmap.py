"""A reader's mapping of a segment is unmapped off the thread that drops its last tensor."""

from __future__ import annotations

import os
import threading

import pytest

from dockd.net import memfd


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == addr for line in f)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")
def test_dropping_the_last_view_of_a_private_mapping_unmaps_it_on_another_thread():
    """The munmap of a get's mapping (~0.1 ms for 2 MB) was paid by the consumer's thread as it dropped
    the batch; the unpin (`on_free`) still follows, once the mapping is gone."""
    fd = os.memfd_create("dockd-test", os.MFD_CLOEXEC)
    try:
        size = 4 * memfd.PAGE
        os.ftruncate(fd, size)
        os.pwrite(fd, b"\x07" * size, 0)
        freed = threading.Event()
        where: list = []

        def on_free() -> None:
            where.append((threading.get_ident(), _mapped(addr)))
            freed.set()

        arr, delta = memfd.map_private(fd, memfd.PAGE, size, on_free=on_free)
        addr = arr.__array_interface__["data"][0]
        assert delta == 0 and int(arr.sum()) == 7 * 3 * memfd.PAGE
        assert _mapped(addr)
        del arr
        assert freed.wait(10), "the mapping was never reported gone"
        (thread, still_mapped), = where
        assert thread != threading.get_ident(), "the consumer's thread unmapped it"
        assert not still_mapped, "on_free ran before the mapping was gone"
    finally:
        os.close(fd)
