"""dock.list(since=cursor) against real daemons: a view of a partition kept up to date from the
changes alone (puts, tags, deletes, retirement), in pages, and made whole again from a full answer
once its cursor is from before a clear or a controller restart with a state dir."""

from __future__ import annotations

import pytest
import torch

import dockd
from tests.conftest import wait_until
from tests.integration.test_cluster import DurableController, Procs

pytestmark = pytest.mark.timeout(120)


class View:
    """What a poller keeps: {index: age tag}, brought up to date by each answer."""

    def __init__(self, dock: dockd.Dock, partition: str, limit: int = 1000) -> None:
        self.dock, self.partition, self.limit = dock, partition, limit
        self.samples: dict[int, int] = {}
        self.cursor = ""
        self.fulls = 0

    def poll(self) -> int:
        """Apply the changes since the last poll (every page); how many entries came."""
        got = 0
        while True:
            r = self.dock.list(self.partition, since=self.cursor, limit=self.limit)
            if r["full"]:
                self.samples.clear()
                self.fulls += 1
            ages = r["tags"].get("age", [0] * len(r["indexes"]))
            self.samples.update(zip(r["indexes"], ages))
            for i in r["deleted"]:
                self.samples.pop(i, None)
            got += len(r["indexes"]) + len(r["deleted"])
            self.cursor = r["cursor"]
            if not r["more"]:
                return got


def listing(dock: dockd.Dock, partition: str) -> dict[int, int]:
    r = dock.list(partition, limit=1 << 20)
    return dict(zip(r["indexes"], r["tags"].get("age", [0] * len(r["indexes"]))))


def test_a_polled_view_follows_puts_tags_deletes_and_retirement(dock, partition):
    dock.create_partition(partition, retire_when_consumed_by=["train"])
    dock.put({"x": torch.ones(10, 2)}, partition=partition, tags={"age": 1})
    view = View(dock, partition, limit=4)
    assert view.poll() == 10 and view.fulls == 1 and view.samples == {i: 1 for i in range(10)}
    assert view.poll() == 0  # unchanged: nothing comes
    dock.put({"x": torch.ones(2, 2)}, partition=partition)
    dock.set_tags(partition, [3], {"age": 5})
    dock.delete(partition, [4])
    b = dock.get("train", ["x"], 2, partition=partition, timeout=10)  # confirmed at once: retired
    assert b.indexes == [0, 1]
    assert view.poll() == 6 and view.fulls == 1
    assert view.samples == listing(dock, partition) and 4 not in view.samples and 0 not in view.samples
    assert view.samples[3] == 5 and view.samples[10] == 0


def test_since_is_refused_with_a_consumer_or_a_cursor_it_never_handed_out(dock, partition):
    dock.put({"x": torch.ones(1, 2)}, partition=partition)
    with pytest.raises(dockd.DockValueError, match="neither consumer nor start"):
        dock.list(partition, "train", since="")
    with pytest.raises(dockd.DockValueError, match="since=''"):
        dock.list(partition, since="not-a-cursor")


def test_a_cleared_partition_answers_an_old_cursor_in_full(dock, partition):
    dock.put({"x": torch.ones(3, 2)}, partition=partition)
    view = View(dock, partition)
    view.poll()
    dock.clear(partition)
    with pytest.raises(dockd.DockNotFound):
        view.poll()
    dock.put({"x": torch.ones(2, 2)}, partition=partition)
    assert view.poll() == 2 and view.fulls == 2 and view.samples == {0: 0, 1: 0}


def test_a_cursor_from_before_a_controller_restart_gets_the_whole_listing(tmp_path):
    procs = Procs()
    try:
        dock = DurableController(procs, str(tmp_path / "state"))
        with dockd.connect(dock.address, reconnect_timeout=60) as d:
            d.put({"x": torch.ones(4, 2)}, partition="p", tags={"age": 2})
            view = View(d, "p")
            view.poll()
            dock.restart()
            wait_until(lambda: "p" in d.stats()["partitions"], what="the controller back")
            d.delete("p", [1])  # a change the view must not miss across the restart
            assert view.poll() == 3 and view.fulls == 2
            assert view.samples == {0: 2, 2: 2, 3: 2} == listing(d, "p")
    finally:
        procs.close()
