"""The client's transport seam and its derived async API, without daemons.

Which transports a client tries for a daemon follows from the registry and the
setting alone; a new transport is one registered class; AsyncDock's methods are
Dock's (signature and documentation written once)."""

from __future__ import annotations

import inspect

import pytest

import dockd
from dockd.config import ClientConfig
from dockd.net import same_host, transport
from dockd.net.candidates import candidates
from dockd.net.device_transport import DeviceLinkTransport
from dockd.net.same_host import ShmTransport
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint, Transport


def ctx(setting: str = "auto", links: bool = False) -> Context:
    return Context(config=ClientConfig(transport=setting), links=object() if links else None)


@pytest.mark.skipif(not same_host.available(), reason="same-host transport is Linux-only")
def test_auto_prefers_shared_memory_to_a_same_host_daemon_then_tcp():
    local = Endpoint("127.0.0.1", 7450, unix="dockd-7450")
    assert candidates(local, ctx()) == [ShmTransport, TcpTransport]
    assert candidates(Endpoint("127.0.0.1", 7450, unix="dockd-7450", warehouse=0), ctx(links=True)) == [
        ShmTransport, DeviceLinkTransport, TcpTransport]
    assert candidates(local, ctx("tcp")) == [TcpTransport]  # DOCKD_TRANSPORT=tcp
    assert candidates(Endpoint("127.0.0.1", 7450), ctx()) == [TcpTransport]  # the daemon serves no socket
    assert candidates(Endpoint("192.0.2.1", 7450, unix="dockd-7450"), ctx()) == [TcpTransport]  # another host


def test_the_last_candidate_always_works_and_each_names_itself():
    for setting in ("auto", "tcp"):
        got = candidates(Endpoint("192.0.2.1", 1, warehouse=3), ctx(setting, links=True))
        assert got[-1] is TcpTransport and got[-1].fallback
    assert {TcpTransport.name, DeviceLinkTransport.name, ShmTransport.name} == {"tcp", "shm"}


def test_a_new_transport_is_one_class_in_the_list(monkeypatch):
    from dockd.net import candidates as chosen

    class Fake(TcpTransport):  # e.g. a Mooncake transport: frames over TCP, payloads its own way
        name = "fake"
        auto = False
        fallback = False
        priority = 50

        @classmethod
        def applies(cls, endpoint, ctx):
            return endpoint.warehouse is not None

    monkeypatch.setattr(chosen, "TRANSPORTS", (Fake, *chosen.TRANSPORTS))
    wh = Endpoint("192.0.2.1", 1, warehouse=0)
    assert candidates(wh, ctx("fake")) == [Fake, TcpTransport]
    assert Fake not in candidates(wh, ctx("auto")) and Fake not in candidates(wh, ctx("tcp"))
    assert candidates(Endpoint("192.0.2.1", 1), ctx("fake")) == [TcpTransport]  # not the controller


def test_the_base_transport_hands_over_only_the_body():
    import numpy as np

    t = Transport(Endpoint("h", 1), Context())
    body = np.zeros(4, dtype=np.uint8)
    reply = transport.Reply(frame=None, body=body, fds=[])
    assert t.buffers([], reply) == {0: (body, 0)} and t.take_unpins() == [] and t.describe() == "h:1"
    assert t.matches(Endpoint("h", 1, unix="x")) and not t.matches(Endpoint("h", 2))


PUBLIC = [n for n, f in vars(dockd.Dock).items() if inspect.isfunction(f) and not n.startswith("_")]


def test_async_dock_has_every_public_dock_method_awaitable_with_its_signature_and_docs():
    assert len(PUBLIC) >= 20
    for name in [*PUBLIC]:
        if name == "close":
            continue
        sync, coro = getattr(dockd.Dock, name), getattr(dockd.AsyncDock, name)
        assert inspect.iscoroutinefunction(coro), name
        assert coro.__doc__ == sync.__doc__ and coro.__doc__, name
        want = [p for p in inspect.signature(sync).parameters.values() if not p.name.startswith("_")]
        assert list(inspect.signature(coro).parameters.values()) == want, name
        assert coro.__qualname__ == f"AsyncDock.{name}"
    assert inspect.iscoroutinefunction(dockd.AsyncDock.close)
