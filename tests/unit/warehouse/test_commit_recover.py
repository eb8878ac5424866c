"""The commits a restart reads back from its data dir (`Committer.recover`): they wait for the link to the
controller that owns their partition and go into its pending commits before it starts (so into its first
registration), also when the node learns only at its join how many controllers the dock has."""

from __future__ import annotations

import asyncio

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.terms import CommitOutcome
from dockd.warehouse.commit import RemoteCommitter, RoutingCommitter


class _Link:
    """A controller link's windowed commits, answered by the test."""

    def __init__(self) -> None:
        self.sent: list[tuple[pb.CommitRequest, asyncio.Future]] = []

    def commit_windowed(self, req: pb.CommitRequest) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((req, fut))
        return fut


def test_recovered_commits_go_to_the_link_of_the_controller_that_owns_their_partition():
    async def main() -> None:
        router = RoutingCommitter([RemoteCommitter(None)])  # (a node that joins: one placeholder until its join)
        outcomes: list[tuple[str, CommitOutcome]] = []
        reqs = [pb.CommitRequest(partition=f"p{k}", indexes=[k], block=1, put_id=k + 1) for k in range(8)]
        for req in reqs:
            router.recover(req, lambda res, name=req.partition: outcomes.append((name, res)))
        router.committers = [RemoteCommitter(None), RemoteCommitter(None)]  # (the dock has two controllers)
        links = [_Link(), _Link()]
        for committer, link in zip(router.committers, links):
            assert not link.sent
            committer.link = link
        for k, link in enumerate(links):
            mine = [r.partition for r in reqs if owners.owner_index(r.partition, 2) == k]
            assert mine and [r.partition for r, _ in link.sent] == mine
        req, fut = links[1].sent[0]
        fut.set_result(CommitOutcome([int(req.indexes[0])]))
        await asyncio.sleep(0)
        assert outcomes == [(req.partition, CommitOutcome([int(req.indexes[0])]))]

    asyncio.run(main())
