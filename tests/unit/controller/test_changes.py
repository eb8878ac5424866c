"""A partition's listing as changes since a cursor (dockd.controller.changes), driven on a controller core."""

from __future__ import annotations

import numpy as np
import pytest

from dockd.controller.changes import list_changes
from dockd.controller.core import Controller
from dockd.errors import DockNotFound, DockValueError


def put(c: Controller, n: int, part: str = "p", **kw) -> list[int]:
    return c.commit(part, ["x"], warehouse=0, new_count=n, **kw).tolist()


def changes(c: Controller, since: str, part: str = "p", **kw):
    return list_changes(c.catalog, part, since, **kw)


def view_of(c: Controller, part: str = "p", limit: int = 1000) -> tuple[dict[int, int], str]:
    """A view {index: age tag} built from the start, page by page; and its cursor."""
    view: dict[int, int] = {}
    ch = changes(c, "", part, limit=limit)
    assert ch.full
    while True:
        view.update(zip(ch.indexes.tolist(), ch.tags.get("age", np.zeros(len(ch.indexes))).tolist()))
        if not ch.more:
            return view, ch.cursor
        ch = changes(c, ch.cursor, part, limit=limit)
        assert not ch.full and not len(ch.deleted)


def apply(view: dict[int, int], ch) -> str:
    if ch.full:
        view.clear()
    view.update(zip(ch.indexes.tolist(), ch.tags.get("age", np.zeros(len(ch.indexes))).tolist()))
    for i in ch.deleted.tolist():
        view.pop(i, None)
    return ch.cursor


def listing(c: Controller, part: str = "p") -> dict[int, int]:
    idx, tags = c.list_samples(part, limit=1 << 20)
    return dict(zip(idx.tolist(), tags.get("age", np.zeros(len(idx))).tolist()))


def test_an_unchanged_partition_answers_nothing_and_the_same_cursor():
    c = Controller()
    put(c, 5, tags={"age": [1]})
    view, cur = view_of(c)
    assert view == {i: 1 for i in range(5)}
    ch = changes(c, cur)
    assert not ch.full and not ch.more and not len(ch.indexes) and not len(ch.deleted)
    assert ch.cursor == cur


def test_writes_tags_and_deletes_since_the_cursor_are_answered_and_nothing_else():
    c = Controller()
    put(c, 6)
    view, cur = view_of(c)
    put(c, 2)  # added: 6, 7
    c.set_tags("p", [1, 6], {"age": [3, 4]})
    c.delete("p", [2])
    ch = changes(c, cur)
    assert ch.indexes.tolist() == [1, 6, 7] and ch.tags["age"].tolist() == [3, 4, 0]
    assert ch.deleted.tolist() == [2] and not ch.full
    apply(view, ch)
    assert view == listing(c)
    assert not len(changes(c, ch.cursor).indexes)


def test_a_sample_written_column_by_column_is_listed_once_written_and_again_when_it_changes():
    c = Controller()
    idx = c.reserve("p", 2)
    _, cur = view_of(c)
    assert not len(changes(c, cur).indexes)  # reserved, nothing written: not listed
    c.commit("p", ["x"], warehouse=0, indexes=idx[:1])
    ch = changes(c, cur)
    assert ch.indexes.tolist() == [int(idx[0])]
    c.commit("p", ["y"], warehouse=0, indexes=idx[:1])
    assert changes(c, ch.cursor).indexes.tolist() == [int(idx[0])]


def test_retired_samples_are_answered_as_deleted():
    c = Controller()
    c.create_partition("p", retire=["train"])
    put(c, 4)
    view, cur = view_of(c)
    r = c.acquire("p", "train", ["x"], 3)
    c.confirm(r.lease)
    ch = changes(c, cur)
    assert sorted(ch.deleted.tolist()) == [0, 1, 2] and not len(ch.indexes)
    apply(view, ch)
    assert view == listing(c) == {3: 0}


def test_where_lists_samples_entering_the_range_and_deletes_those_leaving_it():
    c = Controller()
    put(c, 4, tags={"age": [0, 1, 2, 3]})
    ch = changes(c, "", where={"age": (1, 2)})
    assert ch.indexes.tolist() == [1, 2]
    c.set_tags("p", [0, 1], {"age": [1, 5]})
    ch = changes(c, ch.cursor, where={"age": (1, 2)})
    assert ch.indexes.tolist() == [0] and ch.deleted.tolist() == [1]


def test_pages_cover_every_change_even_those_made_between_pages():
    c = Controller()
    put(c, 10)
    view, cur = view_of(c, limit=3)
    assert view == listing(c)
    c.set_tags("p", [0, 4, 8, 9], {"age": [1]})
    ch = changes(c, cur, limit=2)
    assert ch.more and ch.indexes.tolist() == [0, 4]
    cur = apply(view, ch)
    c.set_tags("p", [1], {"age": [7]})  # behind the page: answered by the next pass
    c.delete("p", [9])  # ahead of it: answered by this pass
    while True:
        ch = changes(c, cur, limit=2)
        cur = apply(view, ch)
        if not ch.more:
            break
    ch = changes(c, cur, limit=100)
    assert 1 in ch.indexes.tolist()
    apply(view, ch)
    assert view == listing(c)


def test_a_cursor_of_a_cleared_partition_gets_the_whole_listing_again():
    c = Controller()
    put(c, 3)
    _, cur = view_of(c)
    c.clear("p")
    with pytest.raises(DockNotFound):
        changes(c, cur)
    put(c, 2)
    ch = changes(c, cur)
    assert ch.full and ch.indexes.tolist() == [0, 1] and not len(ch.deleted)


def test_a_cursor_that_was_never_handed_out_is_refused_with_what_to_do():
    c = Controller()
    put(c, 1)
    with pytest.raises(DockValueError, match="since=''"):
        changes(c, "nonsense")


def test_changes_are_counted_only_once_someone_lists_them():
    c = Controller()
    put(c, 3)
    part = c.catalog.part("p")
    assert part.changed is None and part.seq == 0
    view_of(c)
    put(c, 1)
    assert part.seq == 1 and part.changed is not None and part.changed[3] == 1
