"""A client pointed at the wrong place says so, and soon: a port that is not dockd fails at
once naming what answered, a port where nothing listens is retried briefly (a daemon that is
starting) and then named with what was tried, and a wrong token names the daemon that refused it."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

import dockd
from tests.conftest import serving

pytestmark = pytest.mark.timeout(120)


def test_a_port_that_answers_http_fails_fast_and_says_it_is_not_dockd():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        t0 = time.monotonic()
        with pytest.raises(dockd.DockProtocolError, match="is not a dockd daemon: it answers HTTP") as e:
            dockd.connect(address, connect_timeout=10)
        took = time.monotonic() - t0
    finally:
        server.shutdown()
        server.server_close()
    assert address in str(e.value)
    assert took < 5, f"took {took:.1f}s: the client waited out its connect timeout"


def test_a_port_that_sends_something_else_fails_at_once():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        address = f"127.0.0.1:{srv.getsockname()[1]}"

        def banner():
            conn, _ = srv.accept()
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            time.sleep(5)
            conn.close()

        threading.Thread(target=banner, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(dockd.DockProtocolError, match="is not a dockd daemon: it sent b'SSH-2.0"):
            dockd.connect(address, connect_timeout=10)
        assert time.monotonic() - t0 < 2


def test_a_refused_port_gives_up_within_seconds_and_says_what_it_tried():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(dockd.DockConnectionError) as e:
        dockd.connect(f"127.0.0.1:{port}", connect_timeout=10)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "refused" in msg and "retried for" in msg and "attempts" in msg, msg
    assert 2 <= took < 6, f"took {took:.1f}s"


def test_a_wrong_token_names_the_daemon_that_refused_it(token_file):
    with serving("--controller", "--port", "0", "--token-file", str(token_file)) as (address, _):
        with pytest.raises(dockd.DockAuthError, match="needs the token it was started with") as e:
            dockd.connect(address, token="x" * 32)
        assert address in str(e.value), str(e.value)
        with dockd.connect(address, token=token_file.read_text()) as d:  # the right one still works
            assert d.ping() > 0


def test_the_daemons_grpc_port_says_which_port_to_use(cluster):
    """Finding 9: the gRPC admin port was "not a dockd daemon"; it is one, on the wrong port."""
    node = cluster.nodes[0]
    t0 = time.monotonic()
    with pytest.raises(dockd.DockProtocolError) as e:
        dockd.connect(f"127.0.0.1:{node['grpc_port']}", connect_timeout=10)
    assert time.monotonic() - t0 < 5
    assert str(e.value) == (
        f"127.0.0.1:{node['grpc_port']} is the gRPC port of a dockd daemon (health checks and admin: \"grpc_port\" in "
        f"its ready line, --grpc-port), not the port clients connect to: use 127.0.0.1:{node['port']} (--port)")
