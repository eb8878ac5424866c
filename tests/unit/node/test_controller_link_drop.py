"""A warehouse's link frees the partitions its controller says the dock cleared while the two were apart,
and its log line says which was away: the warehouse, restarted on its data dir (its first join), or the
link to a controller this process had joined (a rejoin)."""

from __future__ import annotations

import asyncio
import logging

from dockd._proto import dockd_pb2 as pb
from dockd.node.controller_link import ControllerLink


class _Wire:
    """The link's connection: answers each registration with the controller's list of cleared partitions."""

    challenge = pb.Challenge(nonce=bytes(16))

    def __init__(self, drop: list[str]) -> None:
        self.drop = drop

    async def request(self, frame: pb.Frame):
        return pb.Frame(register_reply=pb.RegisterReply(id=frame.register.id or 3, drop=self.drop)), b""


def _freed_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "freeing partition" in r.getMessage()]


def test_the_freeing_line_says_which_was_away(caplog):
    async def main():
        freed: list[str] = []
        link = ControllerLink("127.0.0.1:1", make_peer=lambda: None, registration=pb.RegisterWarehouse(),
                              inventory=lambda pending: [], on_drop=freed.append, grace=5.0)
        link.resume(3, 0)  # (restarted on its data dir: its first join is a rejoin)
        await link._register(_Wire(["a"]))  # type: ignore[arg-type]
        await link._register(_Wire(["b"]))  # type: ignore[arg-type]  # (the link lost, then back)
        assert freed == ["a", "b"]

    with caplog.at_level(logging.INFO, logger="dockd.node.controller_link"):
        asyncio.run(main())
    first, later = _freed_lines(caplog)
    assert "partition=a" in first and "this warehouse was down (it restarted on its data dir)" in first, first
    assert "partition=b" in later and "cut off from the controller" in later, later
    assert "the controller was away" not in first + later


def test_a_warehouse_that_never_left_is_not_told_it_restarted(caplog):
    async def main():
        link = ControllerLink("127.0.0.1:1", make_peer=lambda: None, registration=pb.RegisterWarehouse(),
                              inventory=lambda pending: [], on_drop=lambda name: None, grace=5.0)
        await link._register(_Wire([]))  # type: ignore[arg-type]  # (its first join: nothing to free)
        await link._register(_Wire(["c"]))  # type: ignore[arg-type]

    with caplog.at_level(logging.INFO, logger="dockd.node.controller_link"):
        asyncio.run(main())
    (line,) = _freed_lines(caplog)
    assert "cut off from the controller" in line and "restarted" not in line, line
