"""The same-host transport's client end (`dockd.net.same_host.ShmTransport`): what a put asks its
pool to send, and what becomes of its staging buffer with each kind of answer. No daemon: the
request's answer and failure steps are driven directly, as `Pool.send` drives them."""

from __future__ import annotations

import numpy as np
import pytest

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockConnectionError, DockFull, StagingUnknown
from dockd.net import same_host
from dockd.net.same_host import SHM_MIN_BODY, ShmTransport
from dockd.net.transport import Context, Endpoint, Put, Reply

pytestmark = pytest.mark.skipif(not same_host.available(), reason="same-host transport is Linux-only")

NO_BODY = np.empty(0, np.uint8)


def transport() -> ShmTransport:
    return ShmTransport(Endpoint("127.0.0.1", 1, unix="dockd-test", warehouse=0), Context())


def a_put(nbytes: int) -> Put:
    body = codec.Body()
    body.add(memoryview(bytes(range(256)) * (nbytes // 256)))
    return Put(pb.PutRequest(partition="p"), body, answer_s=3.0)


def answered(lent: bool = False) -> Reply:
    return Reply(pb.Frame(put_reply=pb.PutReply(staging_lent=lent)), NO_BODY, [])


def test_a_small_put_goes_in_its_frame_and_its_answer_frees_the_buffers_lent_before_it():
    t = transport()
    big = t.put_request(a_put(SHM_MIN_BODY))
    big.answer(answered(lent=True))  # lent: the warehouse copies out of it after its answer
    assert t.staging._lent and not t.staging._free
    small = t.put_request(a_put(1024))
    assert small.size == 1024 and list(small.fds) == [] and not small.frame.put.staging and small.failed is None
    small.answer(answered())
    assert not t.staging._lent and len(t.staging._free) == 1  # sent after the lend's answer: the buffer is free
    t.close()


def test_a_large_put_is_staged_and_its_descriptor_passed_until_the_warehouse_has_it():
    t = transport()
    put = a_put(SHM_MIN_BODY)
    r = t.put_request(put)
    req = r.frame.put
    assert req.staging and req.shm_size == SHM_MIN_BODY and req.lend_staging and r.size == 0 and not r.buffers
    assert len(r.fds) == 1 and not t.staging._free  # (the buffer is the put's until its answer)
    fd = r.fds[0]
    assert r.answer(answered()).put_reply.staging_lent is False
    (buf,) = t.staging._free  # given back, registered: the next put names it without its descriptor
    assert buf.fd == fd and buf.registered and bytes(buf.view[:256]) == bytes(range(256))
    again = t.put_request(a_put(SHM_MIN_BODY))
    assert list(again.fds) == [] and again.frame.put.staging == req.staging
    again.answer(answered())
    t.close()


def test_a_warehouse_that_forgot_the_buffer_gets_its_descriptor_again_once():
    t = transport()
    t.put_request(a_put(SHM_MIN_BODY)).answer(answered())
    r = t.put_request(a_put(SHM_MIN_BODY))
    assert list(r.fds) == []
    retry = r.failed(StagingUnknown("unknown staging buffer"))
    assert retry is not None and len(retry.fds) == 1 and retry.frame.put.staging == r.frame.put.staging
    assert retry.frame is not r.frame  # (a fresh frame: the pool numbers each one it sends)
    assert retry.failed(StagingUnknown("unknown staging buffer")) is None  # twice: the error is raised
    (buf,) = t.staging._free  # (an answer, if an error: the buffer is the writer's again)
    assert buf.fd >= 0 and not buf.registered
    t.close()


def test_a_put_without_an_answer_drops_its_buffer_and_one_refused_keeps_it():
    t = transport()
    refused = t.put_request(a_put(SHM_MIN_BODY))
    assert refused.failed(DockFull("no room")) is None
    (kept,) = t.staging._free
    lost = t.put_request(a_put(SHM_MIN_BODY))
    assert not t.staging._free  # (the same buffer, taken again)
    assert lost.failed(DockConnectionError("the warehouse went away")) is None
    assert kept.fd == -1 and kept.view is None and not t.staging._free  # the warehouse may still read it
    t.close()


def test_a_fetch_asks_for_device_tier_data_by_handle_only_for_a_device():
    t = transport()
    host = t.fetch_request(0, pb.FetchRequest(partition="p"), None, 1.0)
    assert not host.frame.fetch.device and host.timeout == host.stall == 1.0
    dev = t.fetch_request(0, pb.FetchRequest(partition="p"), object(), 1.0)
    assert dev.frame.fetch.device
    t.close()
