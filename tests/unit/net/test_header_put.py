"""A same-host put of per-sample tensors or of several tensor runs goes before its copy (`ShmTransport.put_request`,
`idle`): the bytes the warehouse's checks read are in the staging buffer when it is sent, the tensors are copied
right after the send by the sending thread, then the buffer's eventfd is signalled; a put never sent is never
copied, and its buffer dropped. A put of one tensor goes with its copy made."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError
from dockd.net import same_host
from dockd.net.same_host import SHM_MIN_BODY, ShmTransport
from dockd.net.transport import Context, Endpoint, Put, Reply

pytestmark = pytest.mark.skipif(not same_host.available() or not hasattr(os, "eventfd"),
                                reason="same-host transport and eventfd are Linux-only")


def transport() -> ShmTransport:
    return ShmTransport(Endpoint("127.0.0.1", 1, unix="dockd-test", warehouse=0), Context())


def a_lists_put(value: float = 1.0) -> Put:
    """A msgpack-like run, then per-sample tensors of `value` concatenated on writing (a `Joined` part)."""
    body = codec.Body()
    body.add(memoryview(b"\x07" * 256), checked=True)
    n = SHM_MIN_BODY // 4 // 8
    body.add(codec.Joined([torch.full((n,), value) for _ in range(8)], [n] * 8, torch.float32, 8 * n * 4))
    return Put(pb.PutRequest(partition="p"), body, answer_s=3.0)


def answered() -> Reply:
    return Reply(pb.Frame(put_reply=pb.PutReply()), np.empty(0, np.uint8), [])


def registered(t: ShmTransport) -> None:
    """The staging buffer registered: its first put passes its descriptor and goes once copied."""
    r = t.put_request(a_lists_put())
    assert not r.frame.put.staging_pending and list(r.fds) == [r.answer.__self__.buf.fd]
    t.idle()
    r.answer(answered())  # (not lent: the next put takes it again)


def test_a_put_goes_before_its_tensors_and_idle_copies_them_then_signals():
    t = transport()
    registered(t)
    r = t.put_request(a_lists_put(2.0))
    req, buf = r.frame.put, r.answer.__self__.buf
    assert req.staging_pending and req.staging_eventfd and list(r.fds) == [buf.efd]  # (its eventfd, once)
    view = buf.view
    tensors = view[256 : req.shm_size]
    assert bytes(view[:256]) == b"\x07" * 256 and np.frombuffer(tensors.tobytes(), np.float32).max() == 1.0  # (not yet)
    with pytest.raises(BlockingIOError):
        os.eventfd_read(buf.efd)
    t.idle()  # (what the connection runs right after the send)
    assert np.frombuffer(tensors.tobytes(), np.float32).min() == 2.0
    assert os.eventfd_read(buf.efd) == 1
    r.answer(answered())
    again = t.put_request(a_lists_put())
    assert again.frame.put.staging_pending and not again.frame.put.staging_eventfd and list(again.fds) == []
    t.idle()
    again.answer(answered())
    t.close()


def test_a_put_never_sent_is_never_copied_and_its_buffer_is_dropped():
    t = transport()
    registered(t)
    r = t.put_request(a_lists_put())
    buf = r.answer.__self__.buf
    assert r.frame.put.staging_pending
    assert r.failed(DockConnectionError("no connection")) is None
    t.idle()  # (a later call's idle: nothing to copy)
    assert buf.view is None and buf.fd == -1 and buf.efd == -1
    t.close()


def tensors_put(*values: float, checked: bytes = b"") -> Put:
    """A put of one tensor run per value (after a msgpack-like run when `checked`), big enough to be staged."""
    body = codec.Body()
    if checked:
        body.add(memoryview(checked), checked=True)
    for v in values:
        body.add(memoryview(torch.full((SHM_MIN_BODY // 4,), v).numpy()).cast("B"))
    return Put(pb.PutRequest(partition="p"), body, answer_s=3.0)


def test_which_bodies_go_before_their_copy():
    assert not tensors_put(1.0).body.late and not tensors_put(1.0, checked=b"\x01").body.late
    assert tensors_put(1.0, 2.0).body.late and a_lists_put().body.late


def test_a_put_of_several_tensor_runs_goes_before_them_and_one_of_a_single_tensor_with_its_copy():
    t = transport()
    registered(t)
    r = t.put_request(tensors_put(3.0, 4.0, checked=b"\x05" * 64))
    req, buf = r.frame.put, r.answer.__self__.buf
    assert req.staging_pending
    view = buf.view
    assert bytes(view[:64]) == b"\x05" * 64 and not (np.frombuffer(view[64 : req.shm_size].tobytes(), np.float32) == 4.0).any()
    t.idle()
    values = np.frombuffer(view[64 : req.shm_size].tobytes(), np.float32)
    assert set(values[values != 0].tolist()) == {3.0, 4.0} and os.eventfd_read(buf.efd) == 1
    r.answer(answered())
    one = t.put_request(tensors_put(6.0))
    b1 = one.answer.__self__.buf
    assert b1.registered and b1.efd >= 0 and not one.frame.put.staging_pending  # (it could go first: it does not)
    assert (np.frombuffer(one.answer.__self__.buf.view[: one.frame.put.shm_size].tobytes(), np.float32) == 6.0).all()
    t.idle()
    one.answer(answered())
    t.close()
