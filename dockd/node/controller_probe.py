"""A controller asks the dock's other controllers for their --controllers list and --shards (see
dockd.controller.agreement): a Hello, as a client of the dock, presenting its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from dockd._proto import dockd_pb2 as pb
from dockd.controller.agreement import PROBE_INTERVAL, Agreement
from dockd.errors import DockConfigError, DockError
from dockd.net import tls, wire
from dockd.net.peer import Peer
from dockd.node.dial import open_link

logger = logging.getLogger(__name__)

FIRST_INTERVAL = 2.0
"""Seconds between tries while another controller has not answered yet."""


async def watch(agreement: Agreement, make_peer: Callable[[], Peer], link_tls: tls.LinkTls | None) -> None:
    """Check every other controller of `agreement`'s list, for as long as this daemon runs."""
    others = [a for a in agreement.controllers if a != agreement.where]
    await asyncio.gather(*(_watch_one(agreement, a, make_peer, link_tls) for a in others))


async def _watch_one(agreement: Agreement, address: str, make_peer: Callable[[], Peer],
                     link_tls: tls.LinkTls | None) -> None:
    answered = False
    while True:
        try:
            theirs, their_shards = await ask(address, agreement.controllers, agreement.where, make_peer, link_tls,
                                             agreement.shards)
        except DockConfigError as e:  # it compared our list with its own and refused
            agreement.observed(address, None, refusal=str(e))
            answered = True
        except (DockError, OSError, asyncio.TimeoutError) as e:
            logger.debug("[controllers] the controller at %s did not answer: %s", address, e)
        else:
            agreement.observed(address, theirs, their_shards=their_shards)
            answered = True
        await asyncio.sleep(PROBE_INTERVAL if answered else FIRST_INTERVAL)


async def ask(address: str, mine: tuple[str, ...], where: str, make_peer: Callable[[], Peer],
              link_tls: tls.LinkTls | None, my_shards: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """The --controllers list of the controller at `address` (empty: it runs alone) and its --shards (as
    `owners.shard_names` gives them), asked by the controller at `where` whose list is `mine`."""
    host, _, port = address.rpartition(":")
    _, peer = await asyncio.wait_for(open_link(make_peer, host, int(port), link_tls), 5.0)
    try:
        assert peer.authed is not None  # (an outgoing connection's, made once it connected)
        await asyncio.wait_for(peer.authed, 10.0)
        reply, _ = await asyncio.wait_for(peer.request(pb.Frame(hello=pb.Hello(
            client=f"the controller at {where}", protocol=wire.PROTOCOL_VERSION, controllers=mine,
            shards=my_shards))), 10.0)
    finally:
        peer.close()
    return list(reply.hello_reply.controllers), list(reply.hello_reply.shards)
