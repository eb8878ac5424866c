"""Shared fixtures: real daemons on loopback, clients, and child-process helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import dockd

torch.set_num_threads(1)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a daemon's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="session")
def cluster():
    """A controller + 2 warehouses shared by tests that use their own partitions."""
    with dockd.start_local(num_warehouses=2, capacity="2GiB") as c:
        yield c


@pytest.fixture
def dock(cluster):
    with dockd.connect(cluster.address) as d:
        yield d


@pytest.fixture
def partition() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


def wait_until(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    """predicate()'s first truthy value; AssertionError naming `what` if none comes within `timeout` s.
    For conditions that the code under test has no event for (another process's state)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def wait_child(pid: int, timeout: float, what: str) -> int:
    """The exit code of forked child `pid`; if it has not exited within `timeout` s it is killed
    and the test fails saying `what` (a child that hangs must not hang the test)."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(what)
        time.sleep(0.1)
    return os.waitstatus_to_exitcode(done[1])


@contextlib.contextmanager
def serving(*args: str, **kwargs):
    """One `dockd serve ARGS` for a test: yields (its address, its process); stopped at the end."""
    from dockd.local import spawn_node

    proc, ready = spawn_node(list(args), **kwargs)
    try:
        yield f"127.0.0.1:{ready['port']}", proc
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


def run_client(code: str, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process (a separate client); sys.argv[1:] = args."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"client process failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def client():
    return run_client


class RawClient:
    """A plain socket speaking dockd frames by hand: for tests that send what the client never would."""

    def __init__(self, address: str, *, authenticate: bool = True, role: str = "client", key: bytes | None = None,
                 unix: str = "", session: bytes = b"") -> None:
        import socket

        from dockd._proto import dockd_pb2 as pb
        from dockd.net import auth, same_host, wire

        self.wire, self.pb = wire, pb
        if unix:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(same_host.unix_address(unix))
        else:
            host, port = address.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=10)
        try:
            self.challenge = self.read()
            assert self.challenge.WhichOneof("kind") == "challenge", self.challenge
            if authenticate:
                a = auth.answer(self.challenge.challenge, role, key, session=session)
                self.send(pb.Frame(id=1 << 40, auth=a))
                reply = self.read()
                assert reply.status.code == pb.OK, reply.status.message
        except BaseException:
            self.sock.close()
            raise

    def send(self, frame, body: bytes = b"") -> None:
        self.sock.sendall(self.wire.header(frame, len(body)) + body)

    def read(self):
        """The next frame (its body, if any, is read and dropped)."""
        head = self._exactly(self.wire.PREFIX.size)
        _, hlen, blen = self.wire.PREFIX.unpack(head)
        frame = self.wire.parse_header(self._exactly(hlen))
        self._exactly(blen)
        return frame

    def call(self, frame, body: bytes = b""):
        self.send(frame, body)
        return self.read()

    def closed(self) -> bool:
        """Whether the daemon hung up (reads what is left until EOF)."""
        try:
            while self.sock.recv(65536):
                pass
        except OSError:  # reset, or timed out (then it was not closed)
            import socket

            return not isinstance(sys.exc_info()[1], socket.timeout)
        return True

    def _exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            out += chunk
        return out

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def raw():
    """raw(address, ...) -> RawClient; closed at the end of the test."""
    made: list[RawClient] = []

    def make(address: str, **kwargs) -> RawClient:
        made.append(RawClient(address, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def proc_stats():
    """proc_stats(pid) -> {"rss": bytes, "fds": open descriptors} of a process (Linux /proc)."""

    def stats(pid: int) -> dict:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}

    return stats


@pytest.fixture
def token_file(tmp_path):
    """A fresh dock token in a 0600 file."""
    path = tmp_path / "dock.token"
    path.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    path.chmod(0o600)
    return path


def pytest_unconfigure(config):
    """The run is over: if this process has not exited two minutes from now, something it left
    behind (a thread stuck in a call, a child it waits for) holds it. Print every thread's stack
    and exit non-zero rather than hang the caller."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
