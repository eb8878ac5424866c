"""Which transports a client tries for a daemon: from the list (`dockd.net.candidates.TRANSPORTS`)
and the setting alone; a new transport is one class in the list."""

from __future__ import annotations

import pytest

from dockd.config import ClientConfig
from dockd.net import same_host
from dockd.net.candidates import candidates
from dockd.net.device_transport import DeviceLinkTransport
from dockd.net.same_host import ShmTransport
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint


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
