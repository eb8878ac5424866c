"""Which process answers at a warehouse's address: a daemon opens every connection with its
challenge, which names its instance (`probe_instance`). Membership asks it of the address of a
warehouse whose connection dropped (refused, or another instance, means the process is gone), and
of an address a registration claims (`AddressProbes`: is the registering process the one there?)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from dockd.controller.clock import Clock
from dockd.errors import DockError
from dockd.net import wire

PROBE_TIMEOUT = 2.0
PROBE_FRESH = 5.0  # seconds a probe's answer about an address decides registrations claiming it

Probe = Callable[[str, int], Awaitable[int | None]]
"""How an address is asked which instance answers there (`probe_instance`)."""


@dataclasses.dataclass(slots=True, eq=False)
class _Probe:
    task: asyncio.Task | None  # running; None once answered
    instance: int | None = None  # as probe_instance returns it
    at: float = 0.0


class AddressProbes:
    """The probes made for registrations that claim an address, and what they found."""

    def __init__(self, probe: Probe, clock: Clock) -> None:
        self.probe = probe
        self.clock = clock
        self._probes: dict[tuple[str, int, int], _Probe] = {}  # (address claimed, claimant) -> who answers there

    def who_answers(self, host: str, port: int, claimant: int) -> tuple[bool, int | None]:
        """(whether known, instance answering at host:port) per a probe made for this claimant's
        registration: started by its first attempt, decided by a retry. A probe that found the
        claimant answering holds for PROBE_FRESH seconds, any other answer for one second (an
        address changing hands may have answered nothing a moment ago)."""
        key = (host, port, claimant)
        now = self.clock()
        p = self._probes.get(key)
        if p is not None and p.task is None and now - p.at <= (PROBE_FRESH if p.instance == claimant else 1.0):
            return True, p.instance
        if p is None or p.task is None:
            if len(self._probes) >= 256:  # (registrations come from daemons only; keep the table small anyway)
                for k in [k for k, q in self._probes.items() if q.task is None and now - q.at > PROBE_FRESH]:
                    del self._probes[k]
            p = self._probes[key] = _Probe(asyncio.ensure_future(self._ask(key)))
        return False, None

    async def _ask(self, key: tuple[str, int, int]) -> None:
        instance = await self.probe(key[0], key[1])
        p = self._probes.get(key)
        if p is not None:
            p.task, p.instance, p.at = None, instance, self.clock()

    def close(self) -> None:
        for p in self._probes.values():
            if p.task is not None:
                p.task.cancel()
        self._probes.clear()


async def probe_instance(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> int | None:
    """The instance of the dockd daemon at host:port; 0 if the connection is refused,
    None if it cannot be told (timeout, not a dockd daemon)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return 0
    except (OSError, asyncio.TimeoutError):
        return None
    try:  # every daemon opens a connection with its challenge, which names its instance
        prefix = await asyncio.wait_for(reader.readexactly(wire.PREFIX.size), timeout)
        hlen, blen = wire.parse_prefix(prefix, 0, 0)
        if hlen > 4096:
            return None
        frame = wire.parse_header(await asyncio.wait_for(reader.readexactly(hlen), timeout))
        return frame.challenge.instance or None
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, DockError):
        return None
    finally:
        writer.close()
