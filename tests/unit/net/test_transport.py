"""The transport seam (`dockd.net.transport`): what the base transport asks its pool to send for a
put and a fetch, and what it makes of the answers. No daemon: the requests are looked at directly."""

from __future__ import annotations

import logging

import numpy as np

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint, Put, Reply, Transport


def a_put(nbytes: int = 64, *, kept: bool = False) -> Put:
    body = codec.Body()
    body.add(memoryview(bytes(nbytes)))
    host = pb.PutRequest(partition="p-host")
    return Put(pb.PutRequest(partition="p"), body, kept=kept, as_host=lambda: (host, body), answer_s=3.0)


def test_the_base_transport_hands_over_only_the_body():
    t = Transport(Endpoint("h", 1), Context())
    body = np.zeros(4, dtype=np.uint8)
    reply = Reply(frame=None, body=body, fds=[])
    assert t.buffers([], reply) == {0: (body, 0)} and t.take_unpins() == [] and t.describe() == "h:1"
    assert t.matches(Endpoint("h", 1, unix="x")) and not t.matches(Endpoint("h", 2))


def test_a_put_is_sent_as_its_frame_and_body_and_answered_with_the_reply_frame():
    put = a_put()
    r = TcpTransport(Endpoint("h", 1, warehouse=0), Context()).put_request(put)
    assert r.frame.put is not put.req and r.frame.put == put.req  # (the frame holds a copy)
    assert r.buffers == put.body.buffers and r.size == put.body.size == 64 and list(r.fds) == []
    assert r.timeout == 3.0 and r.stall is None and r.failed is None and r.then is None
    assert r.watch is not None and r.watch.__func__ is Put.alive  # the put's own check, made per send
    answer = pb.Frame(put_reply=pb.PutReply(indexes=[4, 5]))
    assert r.answer(Reply(answer, np.empty(0, np.uint8), [])) is answer


def test_device_columns_go_to_another_node_as_host_bytes_with_one_warning(caplog):
    t = TcpTransport(Endpoint("h", 1, warehouse=2), Context())
    with caplog.at_level(logging.WARNING, logger="dockd.net.transport"):
        first, second = t.put_request(a_put(kept=True)), t.put_request(a_put(kept=True))
    assert first.frame.put.partition == second.frame.put.partition == "p-host"
    assert len([m for m in caplog.messages if "stored as host bytes" in m]) == 1


def test_a_fetch_waits_as_long_as_its_body_keeps_coming_and_is_answered_with_the_reply():
    req = pb.FetchRequest(partition="p")
    r = TcpTransport(Endpoint("h", 1, warehouse=0), Context()).fetch_request(0, req, None, 2.5)
    assert r.frame.fetch == req and r.timeout == r.stall == 2.5 and r.watch is None and r.then is None
    reply = Reply(pb.Frame(), np.empty(0, np.uint8), [])
    assert r.answer(reply) is reply
