"""Which transports a client tries for a daemon, best first: the built-in ones, listed here.

A new transport is a module of `dockd.net` defining a `dockd.net.transport.Transport`
subclass; it is offered to clients by adding it to `TRANSPORTS`."""

from __future__ import annotations

from dockd.net.device_transport import DeviceLinkTransport
from dockd.net.mooncake import MooncakeTransport
from dockd.net.same_host import ShmTransport
from dockd.net.tcp import TcpTransport
from dockd.net.transport import Context, Endpoint, Transport

#: every built-in transport, best first (`Transport.priority`); the last one is the fallback (TCP)
TRANSPORTS: tuple[type[Transport], ...] = tuple(sorted(
    (ShmTransport, MooncakeTransport, DeviceLinkTransport, TcpTransport), key=lambda c: -c.priority))


def candidates(endpoint: Endpoint, ctx: Context) -> list[type[Transport]]:
    """The transports to try for `endpoint`, best first; the last one is a fallback (TCP)."""
    setting = ctx.config.transport
    return [c for c in TRANSPORTS
            if (c.fallback or setting == c.name or (setting == "auto" and c.auto)) and c.applies(endpoint, ctx)]
