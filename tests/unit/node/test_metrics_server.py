"""The metrics endpoint starts on the daemon's own event loop (uvloop) and answers on the port it reports.

uvloop's Server.sockets is a list where the stdlib's (and typeshed's) is a tuple: compiled with mypyc
(`make test-compiled`), a read typed as the tuple raised TypeError, and `dockd serve --metrics-port`
exited at start.
"""

from __future__ import annotations

import asyncio

import pytest

from dockd.node.metrics import MetricsServer

uvloop = pytest.importorskip("uvloop")


async def _start_and_ask() -> tuple[int, bytes]:
    server = MetricsServer(node=object())  # type: ignore[arg-type]  # (the node is read only by a scrape of /metrics)
    try:  # (closed even when start fails: uvloop's close of a loop with a server open hangs)
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return server.port, answer
    finally:
        server.close()


def test_metrics_server_starts_on_uvloop_and_reports_its_port():
    loop = uvloop.new_event_loop()
    try:
        port, answer = loop.run_until_complete(_start_and_ask())
    finally:
        loop.close()
    assert port > 0
    assert answer.startswith(b"HTTP/1.1 404 "), answer
    assert b"/metrics" in answer
