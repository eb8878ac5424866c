"""GetOptions: a get's arguments made into the acquire frame once, every one checked before anything is sent."""

from __future__ import annotations

import dataclasses

import pytest

from dockd import limits
from dockd.client.options import GetOptions
from dockd.errors import DockTypeError, DockValueError

PLAIN = dict(consumer="c", columns=["x", "y"], count=4, partition="p", timeout=None, groups=False,
             allow_partial=False, shuffle=False, seed=None, dp_rank=None, dp_size=None, mp_group=None, step=None,
             balance_by=None, where=None, order_by=None, prefer_local=False, max_staleness=None)


def opts(**kw) -> GetOptions:
    return GetOptions(**{**PLAIN, **kw})


def test_a_plain_get_is_one_acquire_frame_with_its_fields_and_a_token():
    frame = opts().frame(home=-1)
    req = frame.acquire
    assert frame.WhichOneof("kind") == "acquire"
    assert (req.partition, req.consumer, list(req.columns), req.count) == ("p", "c", ["x", "y"], 4)
    assert req.timeout == -1.0 and req.inline and not req.groups and not req.near  # (no timeout: wait)
    assert req.token & 1 and req.token != opts().frame(home=-1).acquire.token  # a fresh token per acquire


def test_the_options_become_their_request_fields():
    req = opts(timeout=2.5, groups=True, allow_partial=True, shuffle=True, seed=7, where={"age": (None, 3)},
               order_by="-age", max_staleness=0, inline=False, lease_timeout=30).frame(home=-1).acquire
    assert (req.timeout, req.groups, req.allow_partial, req.shuffle, req.inline) == (2.5, True, True, True, False)
    assert req.has_seed and req.seed == 7 and req.order_by == "-age" and req.lease_seconds == 30
    assert req.max_staleness == 1  # (0 on the wire: none)
    assert [(w.name, w.hi) for w in req.where] == [("age", 3)]


def test_rank_aware_options():
    req = opts(dp_rank=1, dp_size=4, step=3, balance_by="len").frame(home=-1).acquire
    assert (req.dp_rank, req.dp_size, req.has_step, req.step, list(req.balance_by)) == (1, 4, True, 3, ["len"])
    req = opts(mp_group=(2, 1, 4)).frame(home=-1).acquire
    assert (req.mp_group, req.mp_rank, req.mp_size, req.dp_size) == (2, 1, 4, 1)


def test_prefer_local_names_the_home_warehouse_once_there_is_one():
    assert opts(prefer_local=True).frame(home=3).acquire.near == 4  # (0 on the wire: none)
    assert opts(prefer_local=True).frame(home=-1).acquire.near == 0
    with pytest.raises(DockValueError, match="prefer_local does not apply to rank-aware gets"):
        opts(prefer_local=True, dp_rank=0, dp_size=2).frame(home=3)


@pytest.mark.parametrize("bad, error, says", [
    (dict(partition=""), DockValueError, "partition must be a non-empty string"),
    (dict(consumer=""), DockValueError, "consumer must be a non-empty string"),
    (dict(columns="x"), DockTypeError, "columns must be a non-empty list"),
    (dict(columns=["x", "x"]), DockValueError, "duplicates"),
    (dict(count=0), DockValueError, "count must be a positive int"),
    (dict(count=True), DockValueError, "count must be a positive int"),
    (dict(count=limits.MAX_SAMPLES + 1), DockValueError, f"at most {limits.MAX_SAMPLES}"),
    (dict(timeout=-1), DockValueError, "timeout must be >= 0"),
    (dict(timeout="1"), DockTypeError, "timeout is a number of seconds"),
    (dict(dp_rank=0), DockValueError, "dp_rank needs dp_size"),
    (dict(step=1), DockValueError, "step and balance_by belong to rank-aware gets"),
    (dict(seed=1 << 64), DockValueError, "seed must be an int"),
    (dict(max_staleness=-1), DockValueError, "max_staleness is an int >= 0"),
    (dict(lease_timeout=0), DockValueError, "lease_timeout must be in"),
])
def test_a_bad_argument_is_refused_before_anything_is_sent(bad, error, says):
    with pytest.raises(error, match=says):
        opts(**bad).frame(home=-1)


def test_made_once_from_the_arguments_as_given():
    o = opts(columns=("x",), timeout=1)
    assert o.columns == ("x",) and o.timeout == 1 and o.inline and o.lease_timeout is None  # (acquire's two: defaults)
    assert list(o.frame(home=-1).acquire.columns) == ["x"]
    assert {f.name for f in dataclasses.fields(GetOptions)} == {*PLAIN, "inline", "lease_timeout", "per_lease"}
