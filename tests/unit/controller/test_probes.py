"""Who answers at a warehouse's address (`dockd.controller.probes`): the probes made for registrations
that claim an address, driven with a fake probe and a clock the test moves (a registration waits for
its probe; what it found holds PROBE_FRESH seconds when it is the claimant, one second otherwise),
and probe_instance against a closed port."""

from __future__ import annotations

import asyncio
import socket

from dockd.controller.probes import PROBE_FRESH, AddressProbes, probe_instance
from tests.unit.controller.fakes import FakeClock


class Probed:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.asked: list[tuple[str, int]] = []
        self.instance = 7  # what answers at every address
        self.probes = AddressProbes(self.probe, self.clock)

    async def probe(self, host: str, port: int) -> int | None:
        self.asked.append((host, port))
        return self.instance

    @staticmethod
    async def settle() -> None:
        for _ in range(3):
            await asyncio.sleep(0)


def test_a_claim_waits_for_its_probe_and_the_claimants_own_answer_holds_for_probe_fresh():
    async def main():
        p = Probed()
        assert p.probes.who_answers("10.0.0.9", 7000, 7) == (False, None)  # asked now; the claim retries
        assert p.probes.who_answers("10.0.0.9", 7000, 7) == (False, None)  # (its probe runs: not a second one)
        await p.settle()
        assert p.asked == [("10.0.0.9", 7000)] and p.probes.who_answers("10.0.0.9", 7000, 7) == (True, 7)
        p.clock.now += PROBE_FRESH
        assert p.probes.who_answers("10.0.0.9", 7000, 7) == (True, 7) and len(p.asked) == 1
        p.clock.now += 0.1
        assert p.probes.who_answers("10.0.0.9", 7000, 7) == (False, None)  # too old: asked again
        await p.settle()
        assert len(p.asked) == 2
        p.probes.close()

    asyncio.run(main())


def test_another_answer_holds_for_one_second():
    async def main():
        p = Probed()
        p.instance = 9  # another process answers there
        p.probes.who_answers("10.0.0.9", 7000, 7)
        await p.settle()
        assert p.probes.who_answers("10.0.0.9", 7000, 7) == (True, 9)
        p.clock.now += 1.1
        assert p.probes.who_answers("10.0.0.9", 7000, 7) == (False, None)
        p.probes.close()

    asyncio.run(main())


def test_a_closed_port_is_answered_with_instance_zero():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert asyncio.run(probe_instance("127.0.0.1", port, timeout=2.0)) == 0
