"""Commits applied as runs: consecutive commits of a warehouse's batch (`CommitBatch`) that add new
samples to one partition, with the same columns and group size, are applied as one. A run costs
one allocation, one write per column, one eligibility refresh per consumer and one journal record
(`RecordWriter.commit_run`; the change itself is `catalog.commit_run`) whatever its length; only
remembering each put id and writer token (for re-sends) stays per commit. Each commit still gets
its own indexes and its own answer, in batch order, as if applied alone.

A commit goes into a run only when applying it alone could not come out differently: new samples
(no explicit indexes, tags or replica), its put id not applied before and its writer token not seen
(a re-send is answered from what was recorded), its partition not pacing puts (`max_pending`) and
not being loaded from a checkpoint. A run that is refused as a whole (the dock full, the partition
sealed, a bad group size, the journal unable to take it) is applied again commit by commit, so each
commit gets the answer it would have got alone (some may fit where all together did not).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from dockd._proto import dockd_pb2 as pb
from dockd.controller.checkpoint import Checkpoints
from dockd.controller.core import Controller
from dockd.controller.journal import Journal, ahead
from dockd.controller.membership import Membership
from dockd.controller.pacing import Pacer
from dockd.controller.waiters import Waiters
from dockd.errors import DockError, to_status
from dockd.terms import CommitOutcome

logger = logging.getLogger(__name__)


class _Service(Protocol):
    """What of `service.ControllerService` a run uses."""

    core: Controller
    journal: Journal | None
    checkpoints: Checkpoints
    pacer: Pacer
    members: Membership
    waiting: Waiters

    def check_owner(self, partition: str) -> None: ...

    def commit_reply(self, req: pb.CommitRequest, res: CommitOutcome, out: pb.CommitReply) -> None: ...


def runs(svc: _Service, commits: Sequence[pb.CommitRequest]) -> list[list[pb.CommitRequest]]:
    """A batch's `commits` cut into runs, in order: consecutive commits that may go into a run (`_plain`)
    and share partition, columns, group size and warehouse go together; any other is a run of one."""
    out: list[list[pb.CommitRequest]] = []
    key: tuple | None = None
    for req in commits:
        if _plain(svc, req):
            k = (req.partition, tuple(req.columns), req.group_size or 1, req.warehouse)
            if k == key:
                out[-1].append(req)
                continue
            key = k
        else:
            key = None
        out.append([req])
    return out


def _plain(svc: _Service, req: pb.CommitRequest) -> bool:
    """Whether applying `req` in a run cannot come out differently from applying it alone."""
    if req.indexes or req.replica or req.tags or req.new_count < 1 or req.partition in svc.checkpoints.loading:
        return False
    core = svc.core
    if req.put_id and req.put_id in core.put_keys.get(req.warehouse, ()):
        return False
    if req.token and req.token in core.catalog.tokens:
        return False
    part = core.partitions.get(req.partition)
    return (part is None or not part.max_pending) and req.partition not in svc.pacer.paced


def apply_run(svc: _Service, run: list[pb.CommitRequest], reply: pb.CommitBatchReply,
              woken: set[str]) -> bool:
    """Apply a run of commits as one (journaled first) and answer each in `reply`; False, with nothing
    applied, when the dock refuses it as a whole: the caller then applies its commits one by one. A fault
    (not a refusal) answers each commit of the run with it, as it would a commit applied alone."""
    first = run[0]
    partition, wid, gs = first.partition, first.warehouse, first.group_size or 1
    entry = svc.members.get(wid)
    if entry is None or not entry.alive:
        return False
    counts = [r.new_count for r in run]
    put_ids = [r.put_id for r in run]
    tokens = [r.token for r in run]
    nbytes = sum(r.nbytes for r in run)
    columns = list(first.columns)
    journal = svc.journal
    try:
        svc.check_owner(partition)
        with ahead(journal):
            if journal is not None:
                journal.room()
                journal.commit_run(partition, columns, wid, gs, counts, nbytes, put_ids, tokens)
            kept = svc.core.commit_run(partition, columns, warehouse=wid, group_size=gs, counts=counts,
                                       nbytes=nbytes, put_ids=put_ids, tokens=tokens)
    except DockError:
        return False
    except Exception as e:  # noqa: BLE001 - a fault: each commit of the run is answered with it, the batch goes on
        logger.error("[controller] a run of %d commits failed partition=%s warehouse=%d", len(run), partition, wid,
                     exc_info=e)
        for _ in run:
            to_status(e, reply.results.add().status)
        return True
    if partition in svc.waiting.by_partition:
        woken.add(partition)
    for req, idx in zip(run, kept):
        svc.commit_reply(req, CommitOutcome(idx), reply.results.add())
    return True
