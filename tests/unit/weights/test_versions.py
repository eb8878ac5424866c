"""The version table's rules (dockd.weights.versions): names, newest, and which versions retire."""

from __future__ import annotations

import pytest

from dockd.errors import DockValueError
from dockd.weights import versions as vt
from dockd.weights.versions import Reader, Version

H = 1000  # hold, ms


def vs(*numbers: int, at: int = 0) -> list[Version]:
    return [Version(n, i, at) for i, n in enumerate(numbers)]


def retire(versions, readers, now=0, keep=2, bases=None):
    return [v.version for v in vt.retirable(versions, readers, keep=keep, hold_ms=H, now_ms=now, bases=bases)]


def test_names():
    assert vt.version_partition("m", 3) == "dockd.weights/m/v3"
    assert vt.version_of("m", "dockd.weights/m/v3") == 3
    assert vt.version_of("m", "dockd.weights/m/readers") is None
    assert vt.version_of("m", "dockd.weights/mm/v3") is None
    for bad in ("", "a/b", " a", 3):
        with pytest.raises(DockValueError, match="model"):
            vt.manifest_partition(bad)  # type: ignore[arg-type]
    with pytest.raises(DockValueError, match="version"):
        vt.version_partition("m", -1)


def test_newest_k_are_kept_and_the_rest_go_without_readers():
    assert retire(vs(0, 1, 2, 3), []) == [0, 1]
    assert retire(vs(3, 0, 2, 1), [], keep=1) == [0, 1, 2]
    assert retire(vs(5), []) == []


def test_a_reader_holds_back_what_it_has_not_passed_until_the_hold_ends():
    behind = Reader("r", 0, taken=0, seen_ms=0)
    assert retire(vs(0, 1, 2, 3), [behind], now=H - 1) == [0]      # it finished 0; 1 is held
    assert retire(vs(0, 1, 2, 3), [behind], now=H) == [0, 1]       # hold over: 1 goes too
    ahead = Reader("s", 1, taken=2, seen_ms=0)
    assert retire(vs(0, 1, 2, 3), [ahead], now=0) == [0, 1]        # past them: nothing held
    fresh = Reader("t", 2, taken=-1, seen_ms=0)
    assert retire(vs(0, 1, 2, 3), [ahead, fresh], now=0) == []     # a new reader holds every one


def test_bases_of_kept_delta_versions_stay():
    bases = {3: 2, 2: 1}
    assert retire(vs(0, 1, 2, 3), [], keep=1, bases=bases) == [0]
    assert retire(vs(0, 1, 2, 3), [], keep=1, bases={3: 0}) == [1, 2]


def test_keep_must_be_positive():
    with pytest.raises(DockValueError, match="keep"):
        vt.retirable(vs(0), [], keep=0, hold_ms=H, now_ms=0)


def test_listings_and_abandoned():
    listing = {"indexes": [4, 5], "tags": {"wv": [7, 6], "t": [10, 20]}}
    assert vt.versions_of(listing) == [Version(6, 5, 20), Version(7, 4, 10)]
    assert vt.newest(vt.versions_of(listing)).version == 7
    assert vt.newest(vt.versions_of(listing), at_least=8) is None
    readers = vt.readers_of({"indexes": [0], "tags": {"taken": [3], "seen": [9]}})
    assert readers == [Reader("", 0, 3, 9)]
    parts = ["dockd.weights/m/v1", "dockd.weights/m/v2", "dockd.weights/m/v3", "dockd.weights/m", "other"]
    assert vt.abandoned("m", parts, complete=[1], publishing=3) == ["dockd.weights/m/v2"]
    assert vt.stale_readers([Reader("a", 0, 0, 0), Reader("b", 1, 0, 16 * H)], hold_ms=H, now_ms=16 * H + 1) == \
        [Reader("a", 0, 0, 0)]
