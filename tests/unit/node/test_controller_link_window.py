"""A warehouse's link keeps at most IN_FLIGHT commit messages on their way to its controller: commits made
while one is unanswered wait, and go together, in order, in one message once it is answered. The
controller's own round trip times the window: an idle controller sees each commit at once."""

from __future__ import annotations

import asyncio

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.config import commits_in_flight
from dockd.errors import DockConnectionError, DockStateFull, DockValueError
from dockd.node import link_commits
from dockd.node.controller_link import ControllerLink


class _Wire:
    """The link's connection: records each request and answers it when the test says."""

    def __init__(self) -> None:
        self.sent: list[tuple[pb.Frame, asyncio.Future]] = []
        self.closed = False

    def request(self, frame: pb.Frame) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((frame, fut))
        return fut

    def commits_of(self, k: int) -> list[int]:
        frame = self.sent[k][0]
        reqs = frame.commits.commits if frame.HasField("commits") else [frame.commit]
        return [r.new_count for r in reqs]

    def answer(self, k: int, first: int) -> None:
        """Answer request k, giving its commits consecutive indexes from `first`."""
        frame, fut = self.sent[k]
        out, at = [], first
        for req in (frame.commits.commits if frame.HasField("commits") else [frame.commit]):
            out.append(pb.CommitReply(indexes=range(at, at + req.new_count)))
            at += req.new_count
        fut.set_result((pb.Frame(commits_reply=pb.CommitBatchReply(results=out)) if frame.HasField("commits")
                        else pb.Frame(commit_reply=out[0]), b""))


def _link() -> tuple[ControllerLink, _Wire]:
    link = ControllerLink("127.0.0.1:1", make_peer=lambda: None, registration=pb.RegisterWarehouse(),
                          inventory=lambda pending: [], on_drop=lambda name: None, grace=5.0)
    wire = _Wire()
    link.peer, link.wid = wire, 3  # type: ignore[assignment]  # (joined: as after _register)
    link.joined.set()
    return link, wire


def _commit(link: ControllerLink, n: int) -> asyncio.Future:
    return link.commit(pb.CommitRequest(partition="p", columns=["x"], new_count=n), 5.0)


async def _turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_commits_made_while_one_is_unanswered_go_together_once_it_is_answered():
    async def main():
        link, wire = _link()
        assert link.in_flight == 1  # (the default)
        a = _commit(link, 1)
        await _turn()
        assert [wire.commits_of(k) for k in range(len(wire.sent))] == [[1]]  # (an idle controller: at once)
        b, c = _commit(link, 2), _commit(link, 3)
        await _turn()
        d = _commit(link, 4)
        await _turn()
        assert len(wire.sent) == 1 and not b.done()  # (waiting for the first answer)
        wire.answer(0, 0)
        await _turn()
        assert a.result().indexes == [0]
        assert len(wire.sent) == 2 and wire.commits_of(1) == [2, 3, 4]  # (one message, in order)
        wire.answer(1, 1)
        await _turn()
        assert [f.result().indexes for f in (b, c, d)] == [[1, 2], [3, 4, 5], [6, 7, 8, 9]]

    asyncio.run(main())


def test_a_lost_connection_frees_the_window_and_without_a_bound_each_turn_goes_at_once():
    async def main():
        link, wire = _link()
        _commit(link, 1)
        await _turn()
        wire.sent[0][1].set_exception(DockConnectionError("lost"))  # (its commit stays pending: the rejoin sends it)
        b = _commit(link, 2)
        await _turn()
        assert len(wire.sent) == 2 and wire.commits_of(1) == [2] and not b.done()
        link.in_flight = 0  # (DOCKD_COMMITS_IN_FLIGHT=0)
        _commit(link, 3)
        await _turn()
        _commit(link, 4)
        await _turn()
        assert [wire.commits_of(k) for k in range(len(wire.sent))] == [[1], [2], [3], [4]]

    asyncio.run(main())


def test_a_windowed_commit_refused_for_a_full_state_dir_goes_again_ahead_of_those_made_since(monkeypatch):
    """Its put was answered: it is neither dropped nor overtaken (the controller drops the blocks a warehouse
    moved past, so a later block's commit applied first would have it cleared)."""
    monkeypatch.setattr(link_commits, "STATE_FULL_RETRY_S", 0.05)

    async def main():
        link, wire = _link()
        link.window = 0.001
        a = link.commit_windowed(pb.CommitRequest(partition="p", columns=["x"], new_count=1, block=1))
        await asyncio.sleep(0.01)
        assert [wire.commits_of(k) for k in range(len(wire.sent))] == [[1]]
        wire.sent[0][1].set_exception(DockStateFull("the state dir is full"))
        await _turn()
        b = link.commit_windowed(pb.CommitRequest(partition="p", columns=["x"], new_count=2, block=2))
        await asyncio.sleep(0.005)  # (b's window goes)
        c = _commit(link, 3)
        await asyncio.sleep(0.02)
        assert len(wire.sent) == 1 and not a.done() and not b.done()  # (held, and the later ones behind it)
        await asyncio.sleep(0.06)
        assert [wire.commits_of(k) for k in range(len(wire.sent))] == [[1], [1, 2, 3]]
        wire.answer(1, 0)
        await _turn()
        assert [f.result().indexes for f in (a, b, c)] == [[0], [1, 2], [3, 4, 5]]

    asyncio.run(main())


@pytest.mark.parametrize("raw", ["-1", "1.5", "nan", "inf", "two"])
def test_a_bad_bound_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("DOCKD_COMMITS_IN_FLIGHT", raw)
    with pytest.raises(DockValueError, match="DOCKD_COMMITS_IN_FLIGHT"):
        commits_in_flight()
    monkeypatch.setenv("DOCKD_COMMITS_IN_FLIGHT", "4")
    assert commits_in_flight() == 4


def test_a_warehouse_given_a_bad_bound_is_refused_at_start(monkeypatch):
    from dockd.config import NodeConfig

    monkeypatch.setenv("DOCKD_COMMITS_IN_FLIGHT", "-1")
    with pytest.raises(DockValueError, match="DOCKD_COMMITS_IN_FLIGHT=-1"):
        NodeConfig(join="127.0.0.1:7450")
    NodeConfig(controller=True)  # (a controller's own warehouse commits by a call: it has no link to bound)
