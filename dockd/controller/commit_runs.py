"""Commits applied as runs: consecutive commits of a warehouse's batch (`CommitBatch`) to one partition,
with the same columns, that add new samples (of one group size) or write columns of existing samples
(`indexes=`), are applied as one. A run costs one allocation (new samples), one check of its indexes
(existing ones), one write per column, one eligibility refresh per consumer and one journal record
(`M` or `I`; the change itself is `catalog_runs`) whatever its length; only remembering each put id
and writer token (for re-sends) stays per commit. Each commit still gets its own indexes and its own
answer, in batch order, as if applied alone.

A commit goes into a run only when applying it alone could not come out differently: no tags or
replica, its put id not applied before and its writer token not seen (a re-send is answered from
what was recorded), its partition not being loaded from a checkpoint, for new samples not
pacing puts (`max_pending`), and for a commit of a block of indexes one from its owner inside its
block (`blocks.Blocks.holds`). Two commits of one run that name the same sample refuse the run. A run
that is refused as a whole (the dock full, the partition sealed, a bad group size, the journal
unable to take it) is applied again commit by commit, so each commit gets the answer it would have
got alone (some may fit where all together did not).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

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


class _Replicas(Protocol):
    @property
    def replicas(self) -> int: ...


class _Service(Protocol):
    """What of `service.ControllerService` a run uses."""

    core: Controller
    journal: Journal | None
    checkpoints: Checkpoints
    pacer: Pacer
    members: Membership
    waiting: Waiters
    @property
    def replication(self) -> _Replicas: ...

    def check_owner(self, partition: str) -> None: ...

    def commit_reply(self, req: pb.CommitRequest, res: CommitOutcome, out: pb.CommitReply) -> None: ...


def runs(svc: _Service, commits: Sequence[pb.CommitRequest]) -> list[list[pb.CommitRequest]]:
    """A batch's `commits` cut into runs, in order: consecutive commits that may go into a run (`_Plain`)
    and share partition, columns, warehouse and kind (new samples of one group size, or columns of
    existing samples) go together; any other is a run of one."""
    out: list[list[pb.CommitRequest]] = []
    key: tuple | None = None
    plain = _Plain(svc)
    for req in commits:
        k = plain.key(req)
        if k is not None and k == key:
            out[-1].append(req)
            continue
        key = k
        out.append([req])
    return out


class _Plain:
    """Which commits may go into a run: those that applying in a run cannot come out differently from
    applying alone. What it looks up is read once per batch (nothing is applied while a batch is cut)."""

    __slots__ = ("loading", "paced", "partitions", "put_keys", "tokens", "blocks")

    def __init__(self, svc: _Service) -> None:
        core = svc.core
        self.loading, self.paced, self.partitions = svc.checkpoints.loading, svc.pacer.paced, core.partitions
        self.put_keys, self.tokens, self.blocks = core.put_keys, core.catalog.tokens, core.blocks

    def key(self, req: pb.CommitRequest) -> tuple | None:
        """The key of the runs `req` may go into (consecutive commits of one key go together), or None when
        it is applied alone. Each field of the request is read once."""
        if req.replica or req.tags:
            return None
        partition, wid = req.partition, req.warehouse
        if partition in self.loading:
            return None
        indexes, new_count = req.indexes[:], req.new_count
        if indexes:  # (columns of existing samples: never paced)
            if new_count:
                return None
        elif new_count < 1:
            return None
        else:
            part = self.partitions.get(partition)
            if (part is not None and part.max_pending) or partition in self.paced:
                return None
        put_id = req.put_id
        if put_id and put_id in self.put_keys.get(wid, ()):
            return None
        token = req.token
        if token and token in self.tokens:
            return None
        block = req.block  # (a block commit: only one that would be applied)
        if block and not self.blocks.holds(block, wid, partition, indexes):
            return None
        return partition, req.columns[:], -1 if indexes else req.group_size or 1, wid


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
    put_ids = [r.put_id for r in run]
    tokens = [r.token for r in run]
    nbytes = sum(r.nbytes for r in run)
    columns = list(first.columns)
    journal = svc.journal
    kept: Sequence[np.ndarray | range]  # (what the catalog remembers: arrays, or ranges of new samples)
    answers: Sequence[Sequence[int]]
    try:
        svc.check_owner(partition)
        with ahead(journal):
            if journal is not None:
                journal.room(adds=not all(r.block for r in run))  # (block commits: their grant added their samples)
            if first.indexes:
                named = [r.indexes[:] for r in run]  # (lists of ints: what the record packs; the arrays, from them)
                written = [np.array(ix, dtype=np.int64) for ix in named]
                if journal is not None:
                    journal.write_run(partition, columns, wid, named, nbytes, put_ids, tokens)
                svc.core.write_run(partition, columns, warehouse=wid, indexes=written, nbytes=nbytes,
                                   put_ids=put_ids, tokens=tokens)
                kept = written
                answers = named
            else:
                counts = [r.new_count for r in run]
                if journal is not None:
                    journal.commit_run(partition, columns, wid, gs, counts, nbytes, put_ids, tokens)
                ranges = svc.core.commit_run(
                    partition, columns, warehouse=wid, group_size=gs, counts=counts, nbytes=nbytes, put_ids=put_ids,
                    tokens=tokens)
                kept = ranges
                answers = ranges
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
    if svc.replication.replicas > 1:  # (where each put is copied to: see commit_reply)
        for i, req in enumerate(run):
            svc.commit_reply(req, CommitOutcome(kept[i]), reply.results.add())
    else:  # (a run's commits are neither re-sent nor cleared: each answer is its indexes, as commit_reply gives them)
        add = reply.results.add
        for ix in answers:
            add(indexes=ix)
    return True
