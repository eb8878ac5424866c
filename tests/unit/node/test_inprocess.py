"""The warehouse daemon's handlers in this process: `Node`s on an asyncio loop bound to loopback
(port 0), driven by a bare client connection over TCP. No subprocess, no client library."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest
import torch

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.config import NodeConfig
from dockd.errors import DockAuthError, DockConnectionError, DockFull, DockNotFound, DockValueError, from_status
from dockd.net import auth, wire
from dockd.net.peer import Peer
from dockd.net.wire import PROTOCOL_VERSION
from dockd.node.daemon import Node
from dockd.node.dispatch import CONTROLLER_KINDS, SERVED_KINDS
from dockd.warehouse.commit import LocalCommitter, RemoteCommitter

KiB = 1 << 10
_NOT_REQUESTS = {"challenge", "auth"}  # the handshake's frames (auth_reply is a reply)


class _Client:
    """A bare client connection: the handshake, then requests answered by id (replies may carry a body)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ids = itertools.count(1)
        self.calls: dict[int, asyncio.Future] = {}
        self.task: asyncio.Task | None = None

    @classmethod
    async def open(cls, port: int) -> _Client:
        c = cls(*await asyncio.open_connection("127.0.0.1", port))
        challenge, _ = await c._read()
        c.task = asyncio.ensure_future(c._replies())
        await c.request(pb.Frame(auth=auth.answer(challenge.challenge, auth.CLIENT, None)))
        return c

    async def _read(self) -> tuple[pb.Frame, bytes | None]:
        _, hlen, blen = wire.PREFIX.unpack(await self.reader.readexactly(wire.PREFIX.size))
        frame = wire.parse_header(await self.reader.readexactly(hlen))
        return frame, (await self.reader.readexactly(blen) if blen else None)

    async def _replies(self) -> None:
        try:
            while True:
                frame, body = await self._read()
                fut = self.calls.pop(frame.id, None)
                if fut is None or fut.done():
                    continue
                if frame.status.code != pb.OK:
                    fut.set_exception(from_status(frame.status))
                else:
                    fut.set_result((frame, body))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            for fut in self.calls.values():
                if not fut.done():
                    fut.set_exception(DockConnectionError(f"closed: {e}"))

    def request(self, frame: pb.Frame, buffers=(), body_size: int = 0) -> asyncio.Future:
        frame.id = next(self.ids)
        fut = self.calls[frame.id] = asyncio.get_running_loop().create_future()
        self.writer.writelines([wire.header(frame, body_size), *buffers])
        return fut

    @property
    def closed(self) -> bool:
        return self.task.done()

    def close(self) -> None:
        self.writer.close()

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task


_clients: list[_Client] = []  # closed when the node they talk to stops


def _cfg(**kw) -> NodeConfig:
    return NodeConfig(host="127.0.0.1", port=0, grpc_port=0, shm=False, **kw)


@contextlib.asynccontextmanager
async def _running(**kw):
    node = Node(_cfg(**kw))
    await node.start()
    try:
        yield node
    finally:
        for client in _clients:
            await client.aclose()
        _clients.clear()
        await node.stop()


async def _connect(node: Node) -> _Client:
    client = await asyncio.wait_for(_Client.open(node.port), 10)
    _clients.append(client)
    return client


async def _put(peer: _Client, partition: str, values: torch.Tensor, timeout: float = 10.0) -> list[int]:
    body = codec.Body()
    cols = codec.encode_columns({"x": values}, body)
    req = pb.PutRequest(partition=partition, columns=cols, new_count=len(values), timeout=timeout)
    reply, _ = await peer.request(pb.Frame(put=req), body.buffers, body.size)
    return list(reply.put_reply.indexes)


async def _fetch(peer: _Client, partition: str, indexes: list[int]) -> bytes:
    req = pb.FetchRequest(partition=partition, columns=[pb.FetchColumn(name="x", indexes=indexes)])
    reply, body = await peer.request(pb.Frame(fetch=req))
    (col,) = reply.fetch_reply.columns
    return b"".join(bytes(body[r.offset : r.offset + r.nbytes]) for r in col.runs)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _requests_of_the_wire() -> set[str]:
    kinds = {f.name for f in pb.Frame.DESCRIPTOR.oneofs_by_name["kind"].fields}
    return {k for k in kinds if not k.endswith("_reply") and k not in _NOT_REQUESTS}


# -- the request table ------------------------------------------------------------------------------
def test_the_table_serves_every_request_kind_of_the_wire():
    wire = _requests_of_the_wire()
    assert wire == SERVED_KINDS
    for cfg in (_cfg(controller=True), _cfg(join="127.0.0.1:1")):
        assert set(Node(cfg).dispatcher.table) == wire


def test_a_warehouse_without_the_controller_refuses_controller_kinds_saying_where_it_is():
    node = Node(_cfg(join="127.0.0.1:1"))
    peer = Peer(node.dispatcher, max_body=0)  # (a connection as handlers get it; never connected)
    for kind in sorted(CONTROLLER_KINDS):
        with pytest.raises(DockValueError, match="warehouse without the controller.*127.0.0.1:1"):
            node.dispatcher.table[kind](peer, pb.Frame(), None, [])


def test_a_warehouse_started_on_port_0_names_the_port_it_bound_when_it_refuses():
    async def main():
        async with (_running(controller=True, capacity=1 << 20) as ctl,
                    _running(join=f"127.0.0.1:{ctl.port}", join_timeout=20, capacity=1 << 20) as node):
            assert node.port  # (asked for port 0: before, the refusal named that, not the port it bound)
            peer = await _connect(node)
            with pytest.raises(DockValueError, match=rf"this daemon \(127.0.0.1:{node.port}\) is a warehouse "
                                                     rf"without the controller; connect clients to the controller "
                                                     rf"at 127.0.0.1:{ctl.port}"):
                await peer.request(pb.Frame(stats=pb.StatsRequest()))

    _run(main())


def test_join_takes_one_controller_or_several_and_names_a_bad_address():
    assert _cfg(join="10.0.0.1:7450").join_addresses == ["10.0.0.1:7450"]
    assert _cfg(join="10.0.0.1:7450, 10.0.0.2:7450").join_addresses == ["10.0.0.1:7450", "10.0.0.2:7450"]
    with pytest.raises(DockValueError, match=r"--join expects HOST:PORT \(or several, comma-separated\), got "
                                             r"'10.0.0.1:7450,10.0.0.2'"):
        _cfg(join="10.0.0.1:7450,10.0.0.2")


def test_unknown_kinds_get_a_clear_error_and_the_connection_stays():
    async def main():
        async with _running(controller=True, capacity=1 << 20) as node:
            peer = await _connect(node)
            with pytest.raises(DockValueError, match="unexpected request kind 'put_reply'"):
                await peer.request(pb.Frame(put_reply=pb.PutReply()))
            with pytest.raises(DockValueError, match="unexpected request kind None"):
                await peer.request(pb.Frame())
            with pytest.raises(DockValueError, match="a fetch request carries no body"):
                await peer.request(pb.Frame(fetch=pb.FetchRequest(partition="p")), [b"abcd"], 4)
            with pytest.raises(DockAuthError, match="daemon-to-daemon"):
                await peer.request(pb.Frame(free=pb.FreeRequest(partition="p")))
            reply, _ = await peer.request(pb.Frame(hello=pb.Hello(client="t", protocol=PROTOCOL_VERSION)))
            assert reply.hello_reply.hosts_controller and reply.hello_reply.warehouse_id == node.wid
            assert not peer.closed

    _run(main())


# -- put and fetch ------------------------------------------------------------------------------------
def test_put_then_fetch_returns_the_bytes_with_the_controller_in_process():
    async def main():
        async with _running(controller=True, capacity=1 << 20) as node:
            assert isinstance(node.committer, LocalCommitter)
            peer = await _connect(node)
            values = torch.arange(100, dtype=torch.int64)
            assert await _put(peer, "p", values) == list(range(100))
            assert await _put(peer, "p", values + 100) == list(range(100, 200))
            assert await _fetch(peer, "p", [5, 6, 150]) == torch.tensor([5, 6, 150]).numpy().tobytes()
            assert node.metrics.put_samples["tcp"] == 200 and node.metrics.get_samples["tcp"] == 3
            with pytest.raises(DockNotFound):
                await _fetch(peer, "nowhere", [0])

    _run(main())


def test_put_then_fetch_through_a_joined_warehouse_commits_over_its_link():
    async def main():
        async with (_running(controller=True, capacity=1 << 20) as ctl,
                    _running(join=f"127.0.0.1:{ctl.port}", join_timeout=20, capacity=1 << 20) as node):
            assert isinstance(node.committer.of("q"), RemoteCommitter) and node.wid >= 0 and node.wid != ctl.wid
            peer = await _connect(node)
            values = torch.arange(10, dtype=torch.float32)
            assert await _put(peer, "q", values) == list(range(10))
            assert await _fetch(peer, "q", list(range(10))) == values.numpy().tobytes()
            assert not node.committer.in_flight("q")
            # the controller files the put under the joined warehouse
            loc, _ = await (await _connect(ctl)).request(
                pb.Frame(locate=pb.LocateRequest(partition="q", columns=["x"], indexes=[0, 9])))
            assert list(loc.locate_reply.locations) == [node.wid, node.wid]

    _run(main())


def test_a_commit_made_while_a_rejoin_is_being_answered_goes_out_after_it():
    """A put whose commit is made while the warehouse's rejoin is on its way to the controller (it is
    not in that rejoin's list of pending commits) is sent once the rejoin is answered, not held until
    the next one."""
    async def main():
        async with (_running(controller=True, capacity=1 << 20) as ctl,
                    _running(join=f"127.0.0.1:{ctl.port}", join_timeout=20, capacity=1 << 20) as node):
            peer = await _connect(node)
            assert await _put(peer, "q", torch.arange(4, dtype=torch.float32)) == [0, 1, 2, 3]
            link = node.uplinks.link
            assert link is not None
            register, made = link._register, []

            async def register_with_a_commit_meanwhile(p):
                task = asyncio.ensure_future(register(p))
                await asyncio.sleep(0)  # (the rejoin is built and sent: it waits for its answer)
                made.append(link.commit(pb.CommitRequest(partition="q", columns=["x"], new_count=2, group_size=1,
                                                         nbytes=8), 10.0))
                await task

            link._register = register_with_a_commit_meanwhile
            link.peer.close()  # the link drops: the warehouse rejoins
            await asyncio.wait_for(link.joined.wait(), 10)
            while not made or not link.joined.is_set():
                await asyncio.sleep(0.01)
            assert (await asyncio.wait_for(made[0], 5)).listed() == [4, 5]

    _run(main())


# -- room ---------------------------------------------------------------------------------------------
def test_a_put_past_capacity_waits_for_room_and_a_clear_frees_it():
    async def main():
        async with _running(controller=True, capacity=64 * KiB) as node:
            writer, other = await _connect(node), await _connect(node)
            big = torch.zeros(4, 1280, dtype=torch.int64)  # 4 samples of 10 KiB
            await _put(writer, "a", big)
            assert node.warehouse.used == 40 * KiB
            second = asyncio.ensure_future(_put(writer, "b", big + 1))
            await asyncio.sleep(0.3)
            # held back, not refused; its connection is not read meanwhile (the writer is pushed back on)
            assert not second.done() and len(node.admission.waiters) == 1
            hello = asyncio.ensure_future(writer.request(pb.Frame(hello=pb.Hello(protocol=PROTOCOL_VERSION))))
            with pytest.raises(DockFull, match="stayed full"):  # a put with a short timeout gives up
                await _put(other, "c", big, timeout=0.2)
            with pytest.raises(DockFull):  # one that could never fit fails at once
                await _put(other, "d", torch.zeros(8, 2048, dtype=torch.int64))
            assert not hello.done()
            reply, _ = await other.request(pb.Frame(clear=pb.ClearRequest(partition="a")))
            assert reply.clear_reply.samples == 4
            assert await asyncio.wait_for(second, 10) == [0, 1, 2, 3]
            await asyncio.wait_for(hello, 10)
            assert await _fetch(writer, "b", [0, 1]) == torch.ones(2, 1280, dtype=torch.int64).numpy().tobytes()
            assert node.warehouse.used == 40 * KiB and node.warehouse.reserved == 0 and not node.admission.waiters

    _run(main())


def test_free_releases_room_and_lets_a_waiting_put_in():
    async def main():
        async with _running(controller=True, capacity=64 * KiB) as node:
            peer = await _connect(node)
            await _put(peer, "a", torch.zeros(4, 1280, dtype=torch.int64))
            assert node.warehouse.used == 40 * KiB
            waiting = asyncio.ensure_future(_put(peer, "b", torch.arange(4 * 1280).view(4, 1280)))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert node.admission.free("a") == 40 * KiB
            assert await asyncio.wait_for(waiting, 10) == [0, 1, 2, 3]
            assert node.warehouse.used == 40 * KiB
            node.admission.free("b", [0, 1, 2])  # some samples: the rest stay readable
            assert await _fetch(peer, "b", [3]) == torch.arange(3 * 1280, 4 * 1280).numpy().tobytes()
            node.admission.free("b")
            assert node.warehouse.used == 0 and node.warehouse.reserved == 0

    _run(main())


def test_a_connection_that_leaves_while_its_put_waits_leaves_the_queue():
    async def main():
        async with _running(controller=True, capacity=64 * KiB) as node:
            first = await _connect(node)
            await _put(first, "a", torch.zeros(4, 1280, dtype=torch.int64))
            other = await _connect(node)
            waiting = asyncio.ensure_future(_put(other, "b", torch.zeros(4, 1280, dtype=torch.int64)))
            await asyncio.sleep(0.2)
            ((_, admitted, conn, _),) = node.admission.waiters
            assert conn in node.listeners.peers
            conn.transport.abort()  # (a paused TCP connection sees its end only once read again: end it here)
            with pytest.raises(DockConnectionError):
                await asyncio.wait_for(waiting, 10)
            assert admitted.cancelled() and conn not in node.listeners.peers
            assert not node.admission.waiters and node.warehouse.reserved == 0
            assert await _put(first, "c", torch.zeros(2, 1280, dtype=torch.int64)) == [0, 1]  # the room is there

    _run(main())
