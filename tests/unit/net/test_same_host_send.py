"""The daemon's end of a same-host connection writes a reply of SHM_COPY_REPLY bytes in one go."""

from __future__ import annotations

import socket

import pytest

from dockd.net import same_host


class _Loop:
    """The event-loop calls UnixTransport makes, recorded (nothing runs)."""

    def __init__(self) -> None:
        self.writers: list[int] = []

    def add_reader(self, fd, cb) -> None:
        pass

    def remove_reader(self, fd) -> None:
        pass

    def add_writer(self, fd, cb) -> None:
        self.writers.append(fd)

    def remove_writer(self, fd) -> None:
        pass

    def call_soon(self, cb, *args) -> None:
        pass


class _Protocol:
    def connection_made(self, transport) -> None:
        self.transport = transport


def _wmem_max() -> int:
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(not same_host.available(), reason="needs Linux Unix sockets")
@pytest.mark.skipif(_wmem_max() < getattr(same_host, "SEND_BUFFER", 1 << 20), reason="net.core.wmem_max below the send buffer asked for")
def test_a_reply_of_the_copy_limit_goes_in_one_write_without_waiting_for_the_reader():
    """With the kernel's default send buffer (208 KiB) a 256 KiB reply went in two writes: the second
    after the event loop waited for the reader to drain the socket (`add_writer`)."""
    daemon, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = _Loop()
    with daemon, client:
        t = same_host.UnixTransport(loop, daemon, _Protocol())
        header = bytes(range(64))
        body = bytes((i * 7) & 0xFF for i in range(same_host.SHM_COPY_REPLY))
        t.writelines([header, body[: 1000], body[1000:]])
        assert loop.writers == [] and not t._out, "the reply was queued behind a full send buffer"
        want = header + body
        got = bytearray()
        client.settimeout(5)
        while len(got) < len(want):
            chunk = client.recv(len(want) - len(got))
            assert chunk, "the daemon's end closed"
            got += chunk
        assert bytes(got) == want
