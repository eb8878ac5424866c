"""A warehouse's --join that names something other than a dockd controller is refused at start, naming the
fix, instead of retrying for ever: a warehouse (its controller is named), and a listener that answers in
another protocol. One that never answers is waited for with the reason given. A controller refuses a warehouse
given another --token-file than its own."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from dockd.local import spawn_node

pytestmark = pytest.mark.timeout(180)


def _join(target: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dockd", "serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port",
                           "0", "--join", target, *extra], capture_output=True, text=True, timeout=90,
                          stdin=subprocess.DEVNULL)


def test_a_join_at_a_warehouse_is_refused_naming_its_controller(tmp_path):
    token, client = tmp_path / "daemon-token", tmp_path / "token"
    for path, char in ((token, "d"), (client, "c")):
        path.write_text(char * 64 + "\n")
        path.chmod(0o600)
    tokens = ["--daemon-token-file", str(token), "--token-file", str(client)]
    common = ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", *tokens, "--log-level", "WARNING"]
    procs = []
    try:
        ctl, cinfo = spawn_node([*common, "--controller"])
        procs.append(ctl)
        wh, winfo = spawn_node([*common, "--join", f"127.0.0.1:{cinfo['port']}"])
        procs.append(wh)
        # (before: authenticated, then "is a warehouse without the controller; retrying" for ever)
        out = _join(f"127.0.0.1:{winfo['port']}", *tokens)
        assert out.returncode != 0, out.stderr[-2000:]
        assert (f"--join 127.0.0.1:{winfo['port']}: that is a dockd warehouse, not a controller; join its "
                f"controller: --join 127.0.0.1:{cinfo['port']}") in out.stderr, out.stderr[-2000:]
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)
            p.stdout.close()


@pytest.mark.parametrize("controller_token, warehouse_token, why", [
    ("a", "b", "its token is not this controller's"),
    pytest.param("a", None, "it has none, but this controller has one", marks=pytest.mark.slow),
    pytest.param(None, "a", "this controller has none", marks=pytest.mark.slow),
])
def test_a_warehouse_with_another_token_file_than_its_controller_is_refused_naming_the_fix(
        tmp_path, controller_token, warehouse_token, why):
    """Before, it joined, and every put of a client holding the controller's token failed on that node
    ("authentication failed: this dock needs the token it was started with")."""
    files = {}
    for name in ("a", "b"):
        files[name] = tmp_path / name
        files[name].write_text(name * 64 + "\n")
        files[name].chmod(0o600)
    # (no --daemon-token-file: a warehouse on the controller's host proves the daemon role with its secret)
    common = ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING"]
    ctl, cinfo = spawn_node([*common, "--controller",
                             *(["--token-file", str(files[controller_token])] if controller_token else [])])
    try:
        out = _join(f"127.0.0.1:{cinfo['port']}", "--join-timeout", "4",
                    *(["--token-file", str(files[warehouse_token])] if warehouse_token else []))
        assert out.returncode != 0, out.stderr[-2000:]
        assert f"were given different --token-file ({why})" in out.stderr, out.stderr[-2000:]
        assert "Give every daemon of the dock the same --token-file" in out.stderr, out.stderr[-2000:]
    finally:
        ctl.terminate()
        ctl.wait(20)
        ctl.stdout.close()


def _listener(reply: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A TCP listener that sends `reply` to each connection and closes it (None: keeps it open, silent)."""
    srv = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            if reply is None:
                held.append(conn)
            else:
                conn.sendall(reply)
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.slow
def test_a_join_at_a_listener_of_another_protocol_is_refused_at_once_and_a_silent_one_says_so():
    http, _ = _listener(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    silent, _ = _listener(None)
    try:
        # (before: "waiting for the controller at ... (); retrying" for ever, the reason empty)
        out = _join(f"127.0.0.1:{http.getsockname()[1]}")
        assert out.returncode != 0 and "is it a dockd controller's --port?" in out.stderr, out.stderr[-2000:]
        assert "within" not in out.stderr.splitlines()[-1], out.stderr[-2000:]  # (refused, not timed out)
        out = _join(f"127.0.0.1:{silent.getsockname()[1]}", "--join-timeout", "8")
        assert out.returncode != 0 and "no dockd greeting within 5 s" in out.stderr, out.stderr[-2000:]
    finally:
        http.close()
        silent.close()
