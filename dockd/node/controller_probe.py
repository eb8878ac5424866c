"""A controller asks the dock's other controllers for their --controllers list and --shards (see
dockd.controller.agreement): a Hello, as a client of the dock, presenting its own. One that refuses it as a
client (another --token-file) disagrees as one with another list does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.controller.agreement import PROBE_INTERVAL, Agreement
from dockd.errors import DockAuthError, DockConfigError, DockError
from dockd.net import tls, wire
from dockd.net.peer import Peer
from dockd.node.dial import open_link

logger = logging.getLogger(__name__)

FIRST_INTERVAL = 2.0
"""Seconds between tries while another controller has not answered yet."""


async def watch(agreement: Agreement, make_peer: Callable[[], Peer], link_tls: tls.LinkTls | None,
                state_dir: str = "") -> None:
    """Check every other controller of `agreement`'s list, for as long as this daemon runs. The first time
    they all agree, the list is recorded in `state_dir` (`owners.record_list`: a later start under another
    list is refused); not before, so a controller started with a mistyped list and restarted with the right
    one is not refused for it."""
    others = [a for a in agreement.controllers if a != agreement.where]
    recorded = not state_dir

    def answered() -> None:
        nonlocal recorded
        if not recorded and agreement.all_agree():
            owners.record_list(state_dir, agreement.controllers, agreement.where)
            recorded = True

    await asyncio.gather(*(_watch_one(agreement, a, make_peer, link_tls, answered) for a in others))


async def _watch_one(agreement: Agreement, address: str, make_peer: Callable[[], Peer],
                     link_tls: tls.LinkTls | None, answered: Callable[[], None]) -> None:
    heard = False
    while True:
        try:
            theirs, their_shards, their_replicas = await ask(address, agreement.controllers, agreement.where,
                                                             make_peer, link_tls, agreement.shards)
        except DockConfigError as e:  # it compared our list with its own and refused
            agreement.observed(address, None, refusal=str(e))
            heard = True
        except DockAuthError as e:  # it refused this controller as a client of the dock, or it could not prove
            # it holds our token (or TLS differs): the dock's clients would be refused by one of the two
            agreement.observed(address, None, refusal=(
                f"the controller at {address} and this controller ({agreement.where}) do not take the same "
                f"clients ({e}): give every controller of the dock the same --token-file (and TLS settings), "
                "then restart the one that differs"))
            heard = True
        except (DockError, OSError, asyncio.TimeoutError) as e:
            logger.debug("[controllers] the controller at %s did not answer: %s", address, e)
        else:
            agreement.observed(address, theirs, their_shards=their_shards, their_replicas=their_replicas)
            heard = True
            answered()
        await asyncio.sleep(PROBE_INTERVAL if heard else FIRST_INTERVAL)


async def ask(address: str, mine: tuple[str, ...], where: str, make_peer: Callable[[], Peer],
              link_tls: tls.LinkTls | None, my_shards: Sequence[str] = ()) -> tuple[list[str], list[str], int]:
    """The --controllers list of the controller at `address` (empty: it runs alone), its --shards (as
    `owners.shard_names` gives them) and its --replicas (0: a version that does not say), asked by the
    controller at `where` whose list is `mine`."""
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
    hello = reply.hello_reply
    return list(hello.controllers), list(hello.shards), hello.replicas
