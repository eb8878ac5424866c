"""A put's msgpack values are checked against its bytes over the real wire: a value that does not
decode, or lengths that split values, get a clear error; the connection and what was stored survive."""

from __future__ import annotations

import msgpack
import pytest
import torch

from dockd._proto import dockd_pb2 as pb
from dockd.net import wire
from tests.integration.test_bad_input import raw_socket, read_reply


@pytest.fixture
def kept(dock, partition):
    data = torch.arange(12, dtype=torch.int64).reshape(4, 3)
    dock.put({"keep": data}, partition=partition)
    yield partition
    b = dock.get("survivor", ["keep"], 4, partition=partition, timeout=10)
    assert torch.equal(torch.stack(b["keep"]), data)


def _msgpack_put(partition: str, lengths: list[int], body: bytes) -> pb.PutRequest:
    req = pb.PutRequest(partition=partition, new_count=len(lengths), group_size=1, timeout=1)
    req.columns.add(name="v").runs.add(kind=pb.MSGPACK, count=len(lengths), lengths=lengths, offset=0,
                                       nbytes=len(body))
    return req


@pytest.mark.parametrize("lengths, body", [
    ([1, 1], b"\xc1\x01"),  # 0xc1 is no msgpack value
    ([1, 3], msgpack.packb(1000) + msgpack.packb(1)),  # 4 bytes of two values, split where no value ends
    ([2], b"\xd9\x05"),  # a str8 of 5 bytes cut after its header
])
def test_msgpack_values_that_do_not_decode_are_refused(cluster, dock, kept, lengths, body):
    with raw_socket(cluster.address) as s:
        s.sendall(wire.header(pb.Frame(id=1, put=_msgpack_put(kept, lengths, body)), len(body)) + body)
        reply = read_reply(s)
        assert reply.status.code == pb.INVALID_ARGUMENT and "not valid msgpack" in reply.status.message, reply.status
        s.sendall(wire.header(pb.Frame(id=2, stats=pb.StatsRequest())))  # the same connection keeps working
        assert read_reply(s).id == 2
    assert dock.stats()["partitions"][kept]["samples"] == 4


def test_a_bodiless_put_of_empty_msgpack_values_gets_a_clear_error(cluster, dock, kept):
    """Zero-byte values add up to a body of none: the put is bodiless, and its values still do not decode
    (this failed an internal assertion and answered with an internal error)."""
    with raw_socket(cluster.address) as s:
        s.sendall(wire.header(pb.Frame(id=1, put=_msgpack_put(kept, [0, 0], b""))))
        reply = read_reply(s)
        assert reply.status.code == pb.INVALID_ARGUMENT and "not valid msgpack" in reply.status.message, reply.status
    assert dock.stats()["partitions"][kept]["samples"] == 4
