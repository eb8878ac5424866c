"""Finding 5 of the hardening review: a body announced in a put frame holds its room from its
admission until it has arrived, and a sender may trickle it at --min-rate. With a 64 MiB warehouse,
60 connections each announcing a 16 MiB put and trickling 4 KiB held the capacity in turns, and an
honest 4 MiB put waited 69.9 s (or failed with DockFull at 30 s) behind their announcements. What
bodies still arriving may hold is now bounded per identity (a uid of this host, a remote host),
not per connection: the slow sender holds one body (a quarter of the capacity at most), and a put
of another identity that fits is let in at once, over the same-host socket or TCP. Real `dockd
serve` on loopback; the slow sender runs as another uid (nobody), which needs root."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import textwrap

import pytest
import torch

import dockd
from dockd.local import spawn_node
from tests.conftest import scrape, value

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not hasattr(os, "setuid") or os.geteuid() != 0, reason="needs root to send as another uid"),
]

MiB = 1 << 20

# Another uid opens N connections over loopback TCP, each announcing a put of 16 MiB and sending
# 4 KiB of it, then 4 KiB a second on each (alive, far under --min-rate), until it is killed.
SLOW = textwrap.dedent("""
    import encodings.idna, os, socket, sys, time
    from dockd.net import auth
    from dockd.net import wire
    from dockd._proto import dockd_pb2 as pb

    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[4])
    token = auth.load_token(sys.argv[3])
    os.setgid(65534)
    os.setuid(65534)

    def read(s):
        def exactly(k):
            out = b""
            while len(out) < k:
                chunk = s.recv(k - len(out))
                if not chunk:
                    raise ConnectionError("closed")
                out += chunk
            return out
        _, hlen, blen = wire.PREFIX.unpack(exactly(wire.PREFIX.size))
        frame = wire.parse_header(exactly(hlen))
        exactly(blen)
        return frame

    def connect():
        s = socket.create_connection((host, port), timeout=10)
        challenge = read(s)
        s.sendall(wire.header(pb.Frame(id=1 << 40, auth=auth.answer(challenge.challenge, auth.CLIENT, token))))
        assert read(s).status.code == pb.OK
        return s

    size = 16 << 20
    run = pb.Run(kind=pb.TENSOR, count=1, dtype="uint8", shape=[size], nbytes=size, offset=0)
    put = pb.PutRequest(partition="slow", new_count=1, group_size=1, timeout=-1,
                        columns=[pb.ColumnData(name="x", runs=[run])])
    conns = []
    for _ in range(n):
        s = connect()
        s.sendall(wire.header(pb.Frame(id=1, put=put), size) + bytes(4096))
        s.setblocking(False)
        conns.append(s)
    s = connect()  # a round trip after them: every announcement is in the daemon's hands
    s.sendall(wire.header(pb.Frame(id=2, stats=pb.StatsRequest())))
    read(s)
    print("announced", flush=True)
    while True:
        time.sleep(1)
        for s in conns:
            try:
                s.send(bytes(4096))
            except OSError:
                pass
""")


def _announced(proc: subprocess.Popen, timeout: float) -> None:
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    assert sel.select(timeout), "the slow sender did not open its connections in time"
    assert proc.stdout.readline().strip() == b"announced", proc.stdout.read()


@pytest.fixture
def node(token_file):
    """One controller+warehouse daemon of 64 MiB with a token (so that another uid may connect over
    TCP); yields (address, metrics port)."""
    proc, ready = spawn_node(["--controller", "--port", "0", "--capacity", "64MiB", "--token-file", str(token_file),
                              "--metrics-port", "0"])
    try:
        yield f"127.0.0.1:{ready['port']}", ready["metrics_port"]
    finally:
        proc.terminate()
        proc.wait(20)
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_slow_sender_of_many_connections_holds_one_share_and_others_get_in(node, token_file):
    address, metrics = node
    host, port = address.rsplit(":", 1)
    slow = subprocess.Popen([sys.executable, "-c", SLOW, host, port, str(token_file), "24"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        _announced(slow, 30)
        token = token_file.read_text()
        with dockd.connect(address, token=token) as d:  # same-host socket: a staged put, its bytes here already
            assert d.put({"x": [torch.ones(4 * MiB, dtype=torch.uint8)]}, partition="honest", timeout=20) == [0]
        with dockd.connect(address, token=token, transport="tcp") as d:  # a body that arrives too, as uid 0
            assert d.put({"x": [torch.ones(4 * MiB, dtype=torch.uint8)]}, partition="honest", timeout=20) == [1]
            got = d.get("c", ["x"], 2, partition="honest", timeout=10)
            assert sorted(got.indexes) == [0, 1] and all(int(x.sum()) == 4 * MiB for x in got["x"])
        # the slow identity holds one body of 16 MiB (a quarter of 64 MiB) while its others wait
        assert value(scrape(metrics), "dockd_warehouse_reserved_bytes") == 16 * MiB
    finally:
        slow.kill()
        slow.wait(10)
        assert slow.stdout is not None
        slow.stdout.close()
