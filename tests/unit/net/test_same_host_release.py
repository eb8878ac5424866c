"""A same-host reply's mapping is unmapped where it costs a call nothing: not by the code that drops the
last of its values, but by the transport's `idle` (run right after a connection sends a request, and by the
flusher), which queues its unpin."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.config import ClientConfig
from dockd.net import memfd, same_host
from dockd.net.transport import Context, Endpoint, Reply

pytestmark = pytest.mark.skipif(not same_host.available(), reason="needs memfd and SCM_RIGHTS (Linux)")

SIZE = 1 << 20


def mapped(addr: int) -> bool:
    """Whether `addr` lies in one of this process's mappings."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def lend(t: same_host.ShmTransport, seg: memfd.Segment) -> list:
    """The values of a reply that passes `seg` whole as one uint8 tensor, decoded by `t`."""
    col = pb.ColumnData(name="x", runs=[pb.Run(kind=pb.TENSOR, count=1, dtype="uint8", shape=[SIZE], offset=0,
                                               nbytes=SIZE, segment=1)])
    reply = Reply(pb.Frame(pins=[seg.sid]), np.empty(0, dtype=np.uint8), [os.dup(seg.fd)])
    return codec.decode_reply([col], t.buffers([col], reply))[0]


@pytest.mark.parametrize("keep", [0, None], ids=["DOCKD_KEEP_MAPPINGS=0", "kept"])
def test_a_reply_mapping_whose_values_are_gone_waits_for_idle_to_be_unmapped_or_kept_and_unpinned(keep):
    """With DOCKD_KEEP_MAPPINGS=0 `idle` unmaps it; by default it keeps it (none of its pages written:
    `dockd.net.reply_maps`); either way its segment is unpinned there, and only there."""
    woken = []
    config = ClientConfig() if keep is None else ClientConfig(keep_mappings=keep)
    t = same_host.ShmTransport(Endpoint("127.0.0.1", 1, unix="x"), Context(config=config, wake=lambda: woken.append(1)))
    seg = memfd.Segment.create(SIZE)  # a warehouse's segment
    seg.writable()[:4] = b"dock"
    values = lend(t, seg)
    x = values[0]
    addr = x.data_ptr()
    assert bytes(x[:4].numpy()) == b"dock" and mapped(addr)
    part = x[8:16]  # a view keeps the mapping
    del values, x
    assert mapped(addr) and not woken
    del part
    assert mapped(addr), "the mapping was unmapped by the code that dropped its last value"
    assert t.take_unpins() == [] and woken  # unpinned only by idle; the flusher woken to do it
    t.idle()
    assert mapped(addr) == (keep is None) and t.take_unpins() == [seg.sid]
    t.idle()  # (nothing left)
    assert t.take_unpins() == []
    t.close()
    assert not mapped(addr)


def test_closing_the_transport_unmaps_what_waits_for_idle_and_then_what_is_let_go():
    t = same_host.ShmTransport(Endpoint("127.0.0.1", 1, unix="x"), Context())
    seg = memfd.Segment.create(SIZE)
    values, later = lend(t, seg), lend(t, seg)
    addr, addr_later = values[0].data_ptr(), later[0].data_ptr()
    del values
    assert mapped(addr) and mapped(addr_later)
    t.close()  # (a Dock's close, or a pool a reconnect replaced)
    assert not mapped(addr) and mapped(addr_later) and t.take_unpins() == [seg.sid]
    del later  # no call comes on a closed transport: unmapped at once
    assert not mapped(addr_later) and t.take_unpins() == [seg.sid]
