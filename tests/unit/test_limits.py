"""A warehouse's batch of commits is bounded commit by commit: a name, a column list or a sample count past
its bound is refused wherever in the batch it is, also after commits with the same names (whose names
the check reads once)."""

from __future__ import annotations

import pytest

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockValueError


def _commit(partition="p", columns=("x", "y"), **kw) -> pb.CommitRequest:
    return pb.CommitRequest(partition=partition, columns=list(columns), indexes=[1], warehouse=1, **kw)


def _check(*commits: pb.CommitRequest) -> None:
    limits.check(pb.Frame(commits=pb.CommitBatch(commits=list(commits))))


@pytest.mark.parametrize(("bad", "says"), [
    (_commit(new_count=limits.MAX_SAMPLES + 1), "samples in one request"),
    (_commit(group_size=limits.MAX_SAMPLES + 1), "samples in one request"),
    (_commit(partition="p" * (limits.MAX_NAME + 1)), "partition name"),
    (_commit(columns=("x", "y" * (limits.MAX_NAME + 1))), "column name"),
    (_commit(columns=[f"c{i}" for i in range(limits.MAX_COLUMNS + 1)]), "columns in one request"),
    (_commit(tags=[pb.Tag(name="t" * (limits.MAX_NAME + 1), values=[1])]), "tag name"),
    (_commit(tags=[pb.Tag(name=f"t{i}", values=[1]) for i in range(limits.MAX_TAGS + 1)]), "tags in one request"),
])
def test_a_commit_past_a_bound_is_refused_after_commits_with_the_same_names(bad, says):
    good = _commit()
    _check(good, good, _commit(tags=[pb.Tag(name="t", values=[1])]), good)  # (within every bound)
    for batch in ([bad], [good, bad], [good, good, bad, good]):
        with pytest.raises(DockValueError, match=says):
            _check(*batch)


def test_too_many_commits_in_a_batch_are_refused():
    with pytest.raises(DockValueError, match="commits in a batch"):
        _check(*[_commit()] * (limits.MAX_COMMIT_BATCH + 1))
