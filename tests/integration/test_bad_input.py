"""Bad input gets a clear error; the daemon keeps serving and loses nothing."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import dockd
import dockd.client.batch
from dockd._proto import dockd_pb2 as pb
from dockd.net import auth, wire


@pytest.fixture
def stored(dock, partition):
    """Samples that must survive every abuse in these tests, bit-exact."""
    data = torch.randn(6, 33, dtype=torch.float32)
    dock.put({"keep": data}, partition=partition)
    yield partition, data
    b = dock.get("survivor", ["keep"], 6, partition=partition, timeout=10)
    assert torch.equal(torch.stack(b["keep"]), data)


def raw_socket(address: str, *, authenticate: bool = True) -> socket.socket:
    """A plain socket to a daemon, past the handshake (as a tokenless client) unless told otherwise."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    challenge = read_reply(s)
    assert challenge.WhichOneof("kind") == "challenge"
    if authenticate:
        s.sendall(wire.header(pb.Frame(id=99, auth=auth.answer(challenge.challenge, auth.CLIENT, None))))
        assert read_reply(s).status.code == pb.OK
    return s


def read_reply(s: socket.socket) -> pb.Frame:
    head = b""
    while len(head) < wire.PREFIX.size:
        chunk = s.recv(wire.PREFIX.size - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    _, hlen, blen = wire.PREFIX.unpack(head)
    raw = b""
    while len(raw) < hlen + blen:
        raw += s.recv(hlen + blen - len(raw))
    return wire.parse_header(raw[:hlen])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda d, p: d.put([1, 2], partition=p), dockd.DockTypeError, "non-empty dict"),
        (lambda d, p: d.put({"x": [1]}, partition=""), dockd.DockValueError, "partition must be a non-empty string"),
        (lambda d, p: d.put({"x": [1]}, partition=3), dockd.DockValueError, "partition must be"),
        (lambda d, p: d.put({"x": [1, 2], "y": [1]}, partition=p), dockd.DockValueError, "same positive number"),
        (lambda d, p: d.put({"x": []}, partition=p), dockd.DockValueError, "same positive number"),
        (lambda d, p: d.put({"x": [1, 2, 3]}, partition=p, group_size=2), dockd.DockValueError, "multiple of group_size=2"),
        (lambda d, p: d.put({"x": [1]}, partition=p, group_size=0), dockd.DockValueError, "group_size must be a positive int"),
        (lambda d, p: d.put({"x": [1]}, partition=p, indexes=[0, 1]), dockd.DockValueError, "2 indexes given for 1"),
        (lambda d, p: d.put({"x": [1]}, partition=p, indexes=["a"]), dockd.DockTypeError, "indexes must be"),
        (lambda d, p: d.put({"new": [1]}, partition=p, indexes=[999]), dockd.DockNotFound, r"\[999\] do not exist"),
        (lambda d, p: d.put({"new": [1]}, partition=p + "-none", indexes=[0]), dockd.DockNotFound, "put new samples first"),
        (lambda d, p: d.put({"keep": [1]}, partition=p, indexes=[0]), dockd.DockValueError, "already written"),
        (lambda d, p: d.put({"x": [object()]}, partition=p), dockd.DockTypeError, "cannot store a value of type object"),
        (lambda d, p: d.put({"x": "abc"}, partition=p), dockd.DockTypeError, "one value per sample"),
        (lambda d, p: d.get("c", ["keep"], 0, partition=p), dockd.DockValueError, "count must be a positive int"),
        (lambda d, p: d.get("c", ["keep"], -3, partition=p), dockd.DockValueError, "count must be a positive int"),
        (lambda d, p: d.get("", ["keep"], 1, partition=p), dockd.DockValueError, "consumer must be"),
        (lambda d, p: d.get("c", "keep", 1, partition=p), dockd.DockTypeError, "list of column names"),
        (lambda d, p: d.get("c", [], 1, partition=p), dockd.DockTypeError, "list of column names"),
        (lambda d, p: d.get("c", ["keep", "keep"], 1, partition=p), dockd.DockValueError, "duplicates"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, timeout=-1), dockd.DockValueError, "timeout must be"),
        (lambda d, p: d.clear(p + "-none"), dockd.DockNotFound, "does not exist"),
        (lambda d, p: dockd.connect("nohostport"), dockd.DockValueError, "host:port"),
        # RL semantics
        (lambda d, p: d.delete(p + "-none", [0]), dockd.DockNotFound, "does not exist"),
        (lambda d, p: d.delete(p, [-1]), dockd.DockNotFound, r"\[-1\] do not exist"),
        (lambda d, p: d.delete(p, ["a"]), dockd.DockTypeError, "indexes must be"),
        (lambda d, p: d.reserve(p, 0), dockd.DockValueError, "count must be a positive int"),
        (lambda d, p: d.reserve(p, 3, group_size=2), dockd.DockValueError, "multiple of group_size=2"),
        (lambda d, p: d.set_tags(p, [0], {}), dockd.DockValueError, "tags is empty"),
        (lambda d, p: d.set_tags(p, [0], {"a b": 1}), dockd.DockValueError, "identifier"),
        (lambda d, p: d.set_tags(p, [0, 1], {"age": [1, 2, 3]}), dockd.DockValueError, "one per sample"),
        (lambda d, p: d.set_tags(p, [0], {f"t{i}": 1 for i in range(17)}), dockd.DockValueError, "tags"),
        (lambda d, p: d.put({"x": [1]}, partition=p, tags={"age": "old"}), dockd.DockTypeError, "tag 'age'"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, where={"age": "old"}), dockd.DockTypeError, "where"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, where={"age": (5, 1)}), dockd.DockValueError, "lo <= hi"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, order_by="age", timeout=1), dockd.DockValueError,
         "no tag 'age'"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, dp_rank=0, dp_size=1 << 20), dockd.DockValueError,
         "data-parallel ranks"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, step=3), dockd.DockValueError, "rank-aware"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, dp_rank=0, dp_size=2, balance_by=3), dockd.DockTypeError,
         "balance_by"),
        (lambda d, p: d.create_partition(p, retire_when_consumed_by=[""]), dockd.DockTypeError, "consumer names"),
        (lambda d, p: d.create_partition(p, group_size=3), dockd.DockValueError, "groups of 1"),
        (lambda d, p: d.save(p, ""), dockd.DockTypeError, "directory"),
        (lambda d, p: d.load("/nonexistent-dockd-ckpt", partition=p + "-new"), dockd.DockNotFound, "no dockd checkpoint"),
    ],
)
def test_bad_arguments_get_clear_errors(dock, stored, call, exc, match):
    partition, _ = stored
    with pytest.raises(exc, match=match):
        call(dock, partition)


def test_rejected_put_leaves_nothing_behind(dock, stored):
    partition, _ = stored
    before = dock.stats()
    with pytest.raises(dockd.DockValueError):
        dock.put({"keep": [torch.zeros(10)], "extra": [torch.zeros(10)]}, partition=partition, indexes=[1])
    after = dock.stats()
    assert after["bytes"] == before["bytes"]
    assert "extra" not in after["partitions"][partition]["columns"]


def test_garbage_bytes_close_the_connection_only(cluster, dock, stored):
    with raw_socket(cluster.address, authenticate=False) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    # the daemon said why (one error frame) and hung up; others are unaffected
    assert data.startswith(wire.MAGIC)
    assert "does not speak the dockd protocol" in wire.parse_header(data[wire.PREFIX.size:]).status.message
    assert dock.stats()["partitions"][stored[0]]["samples"] == 6


def test_oversized_frames_are_refused(cluster, dock, stored):
    for hlen, blen in ((wire.MAX_HEADER + 1, 0), (10, 1 << 62)):
        with raw_socket(cluster.address) as s:
            s.sendall(wire.PREFIX.pack(wire.MAGIC, hlen, blen))
            reply = read_reply(s)
            assert reply.status.code == pb.PROTOCOL and "exceeds" in reply.status.message
            assert s.recv(1) == b""  # then closed
    assert dock.stats()["partitions"][stored[0]]["samples"] == 6


def test_malformed_header_gets_a_protocol_error_and_the_connection_survives(cluster, stored):
    with raw_socket(cluster.address) as s:
        junk = b"\xff\xff\xff\xff\x0f" * 3
        s.sendall(wire.PREFIX.pack(wire.MAGIC, len(junk), 0) + junk)
        reply = read_reply(s)
        assert reply.status.code == pb.PROTOCOL and "not a valid dockd.v1.Frame" in reply.status.message


def test_values_pointing_outside_the_body_are_rejected(cluster, dock, stored):
    partition, _ = stored
    with raw_socket(cluster.address) as s:
        req = pb.PutRequest(partition=partition, new_count=1, group_size=1, timeout=1)
        req.columns.add(name="x").runs.add(kind=pb.TENSOR, count=1, dtype="float32", shape=[100], offset=0, nbytes=400)
        s.sendall(wire.header(pb.Frame(id=1, put=req), 64) + bytes(64))
        reply = read_reply(s)
        assert reply.status.code == pb.PROTOCOL and "runs past" in reply.status.message
        # the same connection keeps working
        s.sendall(wire.header(pb.Frame(id=2, stats=pb.StatsRequest())))
        assert read_reply(s).id == 2
    assert dock.stats()["partitions"][stored[0]]["samples"] == 6


def test_client_vanishing_mid_frame_loses_nothing_and_frees_its_reservation(cluster, dock, stored):
    before = dock.stats()["bytes"]
    for _ in range(3):
        s = raw_socket(cluster.address)
        req = pb.PutRequest(partition=stored[0], new_count=1, group_size=1, timeout=1)
        req.columns.add(name="x").runs.add(kind=pb.TENSOR, count=1, dtype="uint8", shape=[1 << 20], offset=0, nbytes=1 << 20)
        s.sendall(wire.header(pb.Frame(id=1, put=req), 1 << 20) + bytes(1000))  # then vanish mid-body
        s.close()
    with raw_socket(cluster.address) as s:
        s.sendall(wire.PREFIX.pack(wire.MAGIC, 100, 0)[:10])  # a truncated prefix
    assert dock.stats()["bytes"] == before
    assert dock.put({"after": [torch.ones(3)]}, partition=stored[0] + "-after") == [0]


def test_controller_requests_to_a_plain_warehouse_say_where_to_go(cluster):
    wh = cluster.warehouses[1]
    with raw_socket(wh) as s:
        s.sendall(wire.header(pb.Frame(id=1, stats=pb.StatsRequest())))
        reply = read_reply(s)
    assert reply.status.code == pb.INVALID_ARGUMENT and cluster.address in reply.status.message
    # and a client pointed at a warehouse follows it to the controller
    with dockd.connect(wh) as d:
        assert d.address == cluster.address


def test_unpicklable_dock_says_what_to_do(dock):
    import pickle

    with pytest.raises(TypeError, match="pass its address"):
        pickle.dumps(dock)


def test_vanished_sender_gives_back_the_room_it_reserved():
    with dockd.start_local(1, capacity="1MiB") as c, dockd.connect(c.address) as d:
        for _ in range(3):  # each would hold 600 kB of the 1 MiB if its reservation leaked
            s = raw_socket(c.address)
            req = pb.PutRequest(partition="p", new_count=1, group_size=1, timeout=5)
            req.columns.add(name="x").runs.add(kind=pb.TENSOR, count=1, dtype="uint8", shape=[600_000], offset=0, nbytes=600_000)
            s.sendall(wire.header(pb.Frame(id=1, put=req), 600_000) + bytes(1000))
            s.close()
        assert d.put({"x": [torch.zeros(600_000, dtype=torch.uint8)]}, partition="p", timeout=5) == [0]


_META = torch.empty(2, 3, device="meta")  # a shape without data (a model built before its weights load)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        # numbers the wire cannot carry: refused naming the argument, not with protobuf's bare ValueError
        (lambda d, p: d.put({"x": [1]}, partition=p, version=2**63), dockd.DockValueError, "version is the policy"),
        (lambda d, p: d.put({"x": [1]}, partition=p, tags={"age": 2**63}), dockd.DockValueError, "tag 'age'"),
        (lambda d, p: d.put({"x": [1, 2]}, partition=p, tags={"age": [1, 2**64]}), dockd.DockValueError,
         "tag 'age' must hold 64-bit signed ints"),
        (lambda d, p: d.put({"keep": [1]}, partition=p, indexes=[2**63]), dockd.DockValueError, "indexes must hold"),
        (lambda d, p: d.set_version(p, 2**63), dockd.DockValueError, "version must be an int from 0 to"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, where={"age": (0, 2**63)}), dockd.DockValueError,
         r"where\['age'\]'s hi"),
        (lambda d, p: d.get("c", ["keep"], 1, partition=p, shuffle=True, seed=-1), dockd.DockValueError, "seed"),
        (lambda d, p: d.get("c", ["keep"], 2**40, partition=p), dockd.DockValueError, "count must be at most"),
        # tensors on the meta device hold no data: refused naming the column
        (lambda d, p: d.put({"w": _META}, partition=p), dockd.DockValueError, "column 'w': a tensor on the meta device"),
        (lambda d, p: d.put({"w": list(_META)}, partition=p), dockd.DockValueError,
         "column 'w' sample 0: a tensor on the meta device"),
        (lambda d, p: d.put({"w": [torch.zeros(3), _META[0]]}, partition=p), dockd.DockValueError,
         "column 'w' sample 1: a tensor on the meta device"),
        # connect options that are not numbers of seconds
        (lambda d, p: dockd.connect(d.address, connect_timeout=float("nan")), dockd.DockValueError,
         "connect_timeout must be a finite number of seconds > 0, got nan"),
        (lambda d, p: dockd.connect(d.address, reconnect_timeout=float("nan")), dockd.DockValueError,
         "reconnect_timeout must be"),
        (lambda d, p: dockd.connect(d.address, connect_timeout="10"), dockd.DockTypeError, "number of seconds"),
    ],
)
def test_values_the_wire_cannot_carry_get_dock_errors(dock, stored, call, exc, match):
    """Finding 9: these raised protobuf's ValueError, torch's NotImplementedError (without the
    column's name) or the socket module's ValueError."""
    partition, _ = stored
    with pytest.raises(exc, match=match):
        call(dock, partition)
    assert dock.stats()["partitions"][partition]["samples"] == 6  # nothing was applied


def test_an_environment_timeout_that_is_not_a_number_of_seconds_names_the_variable(cluster, monkeypatch):
    monkeypatch.setenv("DOCKD_CONNECT_TIMEOUT", "nan")
    with pytest.raises(dockd.DockValueError, match=r"connect_timeout \(from \$DOCKD_CONNECT_TIMEOUT\) must be"):
        dockd.connect(cluster.address)


def test_an_address_with_a_scheme_is_refused_at_once():
    """connect("http://host:port") looked "http" up as a host name for the whole connect timeout."""
    t0 = time.monotonic()
    with pytest.raises(dockd.DockValueError, match="without a scheme.*not http.*use '127.0.0.1:7450'"):
        dockd.connect("http://127.0.0.1:7450/", connect_timeout=10)
    assert time.monotonic() - t0 < 1  # no name lookup, no retries


def test_stacked_of_a_ragged_column_points_to_padded(dock, partition):
    dock.put({"tokens": [torch.arange(3), torch.arange(5)], "same": [torch.arange(4), torch.arange(4)]},
             partition=partition)
    batch = dock.get("c", ["tokens", "same"], 2, partition=partition, timeout=10)
    with pytest.raises(dockd.DockValueError, match=r"column 'tokens' is ragged .*batch.padded\('tokens'\)"):
        batch.stacked("tokens")
    tokens, lengths = batch.padded("tokens")  # what it points to works
    assert tokens.shape == (2, 5) and lengths.tolist() == [3, 5]
    assert batch.stacked("same").tolist() == [[0, 1, 2, 3]] * 2
    with pytest.raises(dockd.DockValueError, match="is ragged"):
        dockd.client.batch.Batch(partition, [0, 1], {"t": [torch.zeros(2), torch.zeros(3)]}).stacked("t")
