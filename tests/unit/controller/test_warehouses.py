"""A warehouse restarted from its data dir with --drop-damaged-files tells its first rejoin what the
files it dropped held: the controller marks those values lost (DockDataLost naming them), or moves
them to a live replica, while the other values it lacks stay unwritten (never acknowledged); when a
dropped file was too damaged to say, every value it lacks is lost. The journal replays the same.
Pure: the controller core and its journal, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.warehouses import DURABLE_REJOIN, Inventory
from dockd.errors import DockDataLost, DockNotFound


def _dock(core: Controller) -> Controller:
    """Partition p: samples 0-3 and 4-7 (two puts) and 8-9 (never acknowledged: its file never made it),
    all on warehouse 1."""
    for n in (4, 4, 2):
        core.commit("p", ["x"], warehouse=1, new_count=n, nbytes=8 * n)
    return core


def _held() -> dict[str, Inventory]:
    return {"p": Inventory(1, 32, {"x": np.arange(4, 8)})}  # the second put came back


def test_the_values_of_a_dropped_file_are_lost_the_others_unwritten():
    c = _dock(Controller())
    c.rejoin(1, _held(), known=DURABLE_REJOIN, lost={"p": Inventory(1, 0, {"x": np.arange(0, 4)})})
    with pytest.raises(DockDataLost) as e:
        c.locate("p", [0, 1, 2, 3], ["x"])
    assert e.value.indexes == [0, 1, 2, 3]
    assert c.locate("p", [4, 5, 6, 7], ["x"]).tolist() == [[1, 1, 1, 1]]
    with pytest.raises(DockNotFound):  # never acknowledged: unwritten, not lost
        c.locate("p", [8], ["x"])


def test_a_dropped_file_nobody_can_name_makes_every_value_lacking_lost():
    c = _dock(Controller())
    c.rejoin(1, _held(), known=DURABLE_REJOIN, lost=True)
    with pytest.raises(DockDataLost) as e:
        c.locate("p", list(range(10)), ["x"])
    assert e.value.indexes == [0, 1, 2, 3, 8, 9]


def test_a_lost_value_with_a_live_replica_is_read_from_it():
    c = _dock(Controller())
    c.commit_replica("p", ["x"], warehouse=2, indexes=[0, 1], nbytes=16)
    c.rejoin(1, _held(), known=DURABLE_REJOIN, lost={"p": Inventory(1, 0, {"x": np.arange(0, 4)})})
    assert c.locate("p", [0, 1], ["x"]).tolist() == [[2, 2]]
    with pytest.raises(DockDataLost) as e:
        c.locate("p", [2, 3], ["x"])
    assert e.value.indexes == [2, 3]


@pytest.mark.parametrize("lost", [{"p": Inventory(1, 0, {"x": np.arange(0, 4)})}, True])
def test_the_journal_replays_what_was_lost(tmp_path, lost):
    j = Journal(tmp_path)
    c, _ = j.load(lease_timeout=60, now=0.0)
    for n in (4, 4, 2):
        j.commit("p", ["x"], 1, None, n, 1, 8 * n, 0)
        c.commit("p", ["x"], warehouse=1, new_count=n, nbytes=8 * n)
    c.rejoin(1, _held(), known=DURABLE_REJOIN, lost=lost)
    j.rejoin(1, _held(), DURABLE_REJOIN, lost)
    j.sync()
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    with pytest.raises(DockDataLost) as e:  # (8 and 9: unwritten, or lost with the unknown file)
        back.locate("p", list(range(8 if lost is not True else 10)), ["x"])
    assert e.value.indexes == ([0, 1, 2, 3] if lost is not True else [0, 1, 2, 3, 8, 9])
    assert back.locate("p", [4, 5, 6, 7], ["x"]).tolist() == [[1, 1, 1, 1]]
