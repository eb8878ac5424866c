"""Nobody gets in without the dock's token, and clients cannot act as daemons.

Finding 1 of the trust review: a plain client registered a fake warehouse,
freed another client's data behind the controller's back and committed samples
with no data behind them. Each attack is replayed against real daemons."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import dockd
from dockd._proto import dockd_pb2 as pb
from dockd._proto import dockd_pb2_grpc
from dockd.local import read_ready, spawn_node
from dockd.net import auth, wire

pytestmark = pytest.mark.timeout(180)


def test_a_client_cannot_send_daemon_messages(cluster, dock, partition, raw):
    dock.put({"x": torch.arange(4)}, partition=partition)
    c = raw(cluster.address)
    attacks = [
        pb.Frame(id=1, register=pb.RegisterWarehouse(host="127.0.0.1", port=1, capacity=1 << 40,
                                                     protocol=wire.PROTOCOL_VERSION)),
        pb.Frame(id=2, commit=pb.CommitRequest(partition=partition, new_count=20_000_000, group_size=1, columns=["x"],
                                               warehouse=0)),
        pb.Frame(id=3, commit=pb.CommitRequest(partition=partition, new_count=4, columns=["x"], warehouse=1)),
        pb.Frame(id=4, leave=pb.LeaveRequest(id=1)),
        # a client's "replica" of samples would be served if their warehouse were lost
        pb.Frame(id=10, put=pb.PutRequest(partition=partition, indexes=[0], replica=True,
                                          columns=[pb.ColumnData(name="x")])),
        pb.Frame(id=11, replicate=pb.ReplicateRequest(partition=partition, indexes=[0], columns=["x"],
                                                      target=pb.WarehouseInfo(id=1, host="127.0.0.1", port=1))),
    ]
    for frame in attacks:
        reply = c.call(frame)
        assert reply.status.code == pb.AUTH and "daemon-to-daemon" in reply.status.message, reply
    # a warehouse frees data only when its controller says so
    w = raw(cluster.warehouses[1])
    for k, frame in enumerate((pb.Frame(free=pb.FreeRequest(partition=partition)),
                               pb.Frame(free=pb.FreeRequest(partition=partition, indexes=[0, 1])),
                               pb.Frame(measure=pb.MeasureRequest(partition=partition, column="x", indexes=[0])))):
        frame.id = 5 + k
        reply = w.call(frame)
        assert reply.status.code == pb.AUTH, reply
    # claiming the daemon role without the dock's daemon secret fails at the handshake
    with pytest.raises(AssertionError, match="daemon failed"):
        raw(cluster.address, role=auth.DAEMON)
    # nothing changed: two warehouses, the partition intact
    stats = dock.stats()
    assert len(stats["warehouses"]) == 2 and stats["partitions"][partition]["samples"] == 4
    assert dock.get("c", ["x"], 4, partition=partition, timeout=10).indexes == [0, 1, 2, 3]


def test_with_a_token_every_connection_proves_it_and_the_token_never_shows(tmp_path, token_file, raw):
    log = tmp_path / "daemons.log"
    token = token_file.read_text()
    with open(log, "w") as err:
        cmd = [sys.executable, "-m", "dockd", "--log-level", "DEBUG", "serve", "--controller", "--port", "0",
               "--token-file", str(token_file)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    try:
        ready = read_ready(proc)
        address = f"127.0.0.1:{ready['port']}"
        with pytest.raises(dockd.DockAuthError, match="requires a token.*DOCKD_TOKEN_FILE"):
            dockd.connect(address)
        with pytest.raises(dockd.DockAuthError, match="needs the token it was started with"):
            dockd.connect(address, token="x" * 32)
        with dockd.connect(address, token=token) as d:
            d.put({"x": [1, 2]}, partition="p")
            assert d.get("c", ["x"], 2, partition="p", timeout=10)["x"] == [1, 2]
            stats = json.dumps(d.stats())
        # a raw connection that skips the handshake is refused and closed
        c = raw(address, authenticate=False)
        reply = c.call(pb.Frame(id=1, stats=pb.StatsRequest()))
        assert reply.status.code == pb.AUTH and c.closed()
        # the proof travels, never the token: not in stats, not in the daemon's log even at DEBUG
        assert token not in stats
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()
    text = log.read_text()
    assert "[node] serving" in text and token not in text


def test_a_daemon_that_does_not_hold_the_token_is_not_believed():
    """Mutual authentication: a fake daemon answering the handshake without the token is caught."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def fake():
        conn, _ = server.accept()
        with conn:
            challenge = pb.Challenge(nonce=b"n" * 32, protocol=wire.PROTOCOL_VERSION, token=True, instance=1)
            conn.sendall(wire.header(pb.Frame(challenge=challenge)))
            head = conn.recv(wire.PREFIX.size)
            _, hlen, _ = wire.PREFIX.unpack(head)
            request = wire.parse_header(conn.recv(hlen))
            conn.sendall(wire.header(pb.Frame(id=request.id, reply=True, auth_reply=pb.AuthReply(mac=b"\0" * 32))))
            conn.recv(1)

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    try:
        with pytest.raises(dockd.DockAuthError, match="did not prove it holds the dock's token"):
            dockd.connect(f"127.0.0.1:{port}", token="y" * 32, connect_timeout=5)
    finally:
        server.close()


def test_a_warehouse_token_proof_holds_for_its_own_link_and_token_only():
    """What a controller checks of a joining warehouse's --token-file (the refusals through real daemons:
    tests/integration/test_join_refusals.py)."""
    ours, theirs = b"a" * 32, b"b" * 32
    link, other = (pb.Challenge(nonce=bytes([k]) * 32) for k in (1, 2))
    auth.check_token_proof(link, auth.token_proof(link, ours), ours, "w")
    auth.check_token_proof(link, auth.token_proof(link, None), None, "w")
    assert auth.token_proof(link, None) == b"" and ours not in auth.token_proof(link, ours)
    for proof, key, why in ((auth.token_proof(link, theirs), ours, "its token is not this controller's"),
                            (auth.token_proof(other, ours), ours, "its token is not this controller's"),
                            (b"", ours, "it has none, but this controller has one"),
                            (auth.token_proof(link, ours), None, "this controller has none")):
        with pytest.raises(dockd.DockConfigError, match=f"w and this controller were given different --token-file "
                                                        f"\\({why}\\)"):
            auth.check_token_proof(link, proof, key, "w")


def test_binding_beyond_loopback_needs_a_token_or_insecure(token_file):
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--controller", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--token-file" in out.stderr and "--insecure" in out.stderr, out.stderr
    for extra in (["--insecure"], ["--token-file", str(token_file)]):
        proc, ready = spawn_node(["--controller", "--host", "0.0.0.0", "--port", "0", *extra])
        try:
            assert ready["controller"]
        finally:
            proc.terminate()
            proc.wait(20)
            proc.stdout.close()


def test_grpc_admin_needs_the_token_but_health_checks_do_not(token_file):
    token = token_file.read_bytes().strip()
    proc, ready = spawn_node(["--controller", "--port", "0", "--token-file", str(token_file)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            admin = dockd_pb2_grpc.AdminStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                admin.Stats(pb.StatsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            signed = auth.grpc_metadata(token, "/dockd.v1.Admin/Stats")
            assert admin.Stats(pb.StatsRequest(), metadata=signed, timeout=10).warehouses[0].alive
            with pytest.raises(grpc.RpcError) as e:  # a captured call cannot be replayed
                admin.Stats(pb.StatsRequest(), metadata=signed, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError):
                admin.Stats(pb.StatsRequest(), metadata=auth.grpc_metadata(b"z" * 32, "/dockd.v1.Admin/Stats"),
                            timeout=10)
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


def test_a_separate_daemon_token_keeps_token_holding_clients_out_of_the_daemon_role(tmp_path, token_file, raw):
    daemon_token = tmp_path / "daemon.token"
    daemon_token.write_text("d" * 64)
    daemon_token.chmod(0o600)
    args = ["--token-file", str(token_file), "--daemon-token-file", str(daemon_token)]
    p0, r0 = spawn_node(["--controller", "--port", "0", *args])
    p1, r1 = spawn_node(["--port", "0", "--join", f"127.0.0.1:{r0['port']}", *args])
    try:
        address = f"127.0.0.1:{r0['port']}"
        client_key = token_file.read_bytes().strip()
        with pytest.raises(AssertionError, match="daemon failed"):  # the client token does not make a daemon
            raw(address, role=auth.DAEMON, key=client_key)
        with dockd.connect(address, token=client_key, warehouse=r1["warehouse"]) as d:  # the warehouse joined
            assert d.put({"x": [1]}, partition="p") == [0]
    finally:
        for p in (p1, p0):
            p.terminate()
            p.wait(20)
            p.stdout.close()


def test_the_dock_token_alone_never_proves_the_daemon_role(tmp_path, token_file, raw):
    """Finding 1 of the second review: with only --token-file (the multi-node recipe of old), any
    client could authenticate as a daemon with the dock token and register over a live warehouse."""
    args = ["--token-file", str(token_file)]
    p0, r0 = spawn_node(["--controller", "--port", "0", *args])
    p1, r1 = spawn_node(["--port", "0", "--join", f"127.0.0.1:{r0['port']}", *args])  # same host: reads the secret
    try:
        address = f"127.0.0.1:{r0['port']}"
        client_key = token_file.read_bytes().strip()
        with pytest.raises(AssertionError, match="daemon-token-file"):
            raw(address, role=auth.DAEMON, key=client_key)
        with pytest.raises(AssertionError, match="daemon failed"):  # nor at a warehouse
            raw(f"127.0.0.1:{r1['port']}", role=auth.DAEMON, key=client_key)
        with dockd.connect(address, token=client_key, warehouse=r1["warehouse"]) as d:
            assert d.put({"x": [1]}, partition="p") == [0]
            assert [w["state"] for w in d.stats()["warehouses"].values()] == ["joined", "joined"]
    finally:
        for p in (p1, p0):
            p.terminate()
            p.wait(20)
            p.stdout.close()


def test_a_warehouse_without_the_daemon_token_cannot_join_from_elsewhere(tmp_path, token_file):
    """A warehouse that finds no controller secret on its host (as on another node) and has no
    daemon token stays out, and says what it needs."""
    args = ["--token-file", str(token_file)]
    p0, r0 = spawn_node(["--controller", "--port", "0", *args])
    env = dict(__import__("os").environ, XDG_RUNTIME_DIR=str(tmp_path))  # where no secret file is
    p1 = subprocess.Popen([sys.executable, "-m", "dockd", "serve", "--port", "0", "--join", f"127.0.0.1:{r0['port']}",
                           *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        err = ""
        for line in p1.stderr:
            err += line
            if "daemon-token-file" in line:
                break
        assert "no daemon token" in err, err
        with dockd.connect(f"127.0.0.1:{r0['port']}", token=token_file.read_bytes().strip()) as d:
            assert list(d.stats()["warehouses"]) == [0]  # the controller's own; the other never joined
    finally:
        for p in (p1, p0):
            p.terminate()
            p.wait(20)
        p0.stdout.close()
        p1.stderr.close()


@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="needs SO_PEERCRED (Linux)")
def test_the_same_host_socket_refuses_other_users(cluster, client):
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    with dockd.connect(cluster.address) as d:
        unix = d._router.ctrl.via.endpoint.unix
    assert unix, "the controller serves a same-host socket"
    code = """
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect("\\0" + sys.argv[1])
got = b""
while chunk := s.recv(4096):
    got += chunk
print(got.hex())
"""
    out = client(code, unix)
    _assert_refused_as_another_user(bytes.fromhex(out.stdout.strip()))


def test_without_a_token_loopback_tcp_refuses_other_users(cluster, client):
    """Finding 9 of the second review: another uid (nobody) read root's partition and cleared it
    over TCP; only the same-host Unix socket checked who was calling."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    host, port = cluster.address.rsplit(":", 1)
    code = """
import encodings.idna, os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
got = b""
while chunk := s.recv(4096):
    got += chunk
print(got.hex())
"""
    out = client(code, host, port)
    _assert_refused_as_another_user(bytes.fromhex(out.stdout.strip()))
    with dockd.connect(cluster.address) as d:  # its own user is served as before
        assert d.stats()["version"]


def _assert_refused_as_another_user(got: bytes) -> None:
    """Closed before the challenge, after one frame saying why (and nothing else)."""
    _, hlen, blen = wire.PREFIX.unpack(got[: wire.PREFIX.size])
    frame = wire.parse_header(got[wire.PREFIX.size : wire.PREFIX.size + hlen])
    assert len(got) == wire.PREFIX.size + hlen and blen == 0, got
    assert frame.WhichOneof("kind") is None and frame.status.code == pb.AUTH, frame
    assert "serves only the user it runs as (uid 0), and this client runs as uid 65534" in frame.status.message


def test_a_client_of_another_user_is_told_the_dock_refuses_its_user(cluster, client):
    """Finding 9: it was told "closed the connection (did the daemon stop?)"."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    code = """
import encodings.idna, os, sys
import dockd, dockd.client, dockd.net.tcp  # (as root: the checkout need not be readable by nobody)
os.setgid(65534); os.setuid(65534)
try:
    dockd.connect(sys.argv[1], connect_timeout=10)
except dockd.DockAuthError as e:
    print(e)
"""
    out = client(code, cluster.address)
    assert (f"dockd at {cluster.address} refused this client: this dock has no token, so it serves only the user it "
            "runs as (uid 0), and this client runs as uid 65534: run the client as that user, or start the dock's "
            "daemons with --token-file") in out.stdout, out.stdout + out.stderr


def test_a_client_with_a_token_at_a_dock_without_one_is_told_so(cluster):
    """Finding 9: it was told the daemon "did not prove it holds the dock's token"."""
    with pytest.raises(dockd.DockAuthError, match=f"the dock at {cluster.address} runs without a token .* connect "
                                                  "without it, or start the dock's daemons with --token-file"):
        dockd.connect(cluster.address, token="z" * 32, connect_timeout=10)
