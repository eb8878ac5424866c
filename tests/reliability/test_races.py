"""Races between clients that each do something legitimate (from the second trust review)."""

from __future__ import annotations

import threading

import pytest
import torch

import dockd

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("where", [0, 1], ids=["controller-warehouse", "joined-warehouse"])
def test_a_clear_racing_a_putter_fails_no_put(cluster, partition, where):
    """Finding 10: 15 of ~4,500 new-sample puts failed with "column 'x' is already written" while
    another client cleared the partition: a put the controller applied before the clear was
    stored after the warehouse had freed the partition, under indexes the next put got again."""
    errors: list[BaseException] = []
    done = threading.Event()

    def putter() -> None:
        with dockd.connect(cluster.address, warehouse=where) as d:
            try:
                for _ in range(1500):
                    d.put({"x": torch.zeros(4)}, partition=partition, timeout=10)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                done.set()

    t = threading.Thread(target=putter)
    t.start()
    clears = 0
    with dockd.connect(cluster.address) as d:
        while not done.is_set():
            try:
                d.clear(partition)
                clears += 1
            except dockd.DockNotFound:  # between two clears nothing was put yet
                pass
        t.join()
        assert not errors, errors[0]
        assert clears > 10
        # what is left is whole: every sample of the partition can be read
        n = d.stats()["partitions"].get(partition, {"samples": 0})["samples"]
        if n:
            assert len(d.get("c", ["x"], n, partition=partition, timeout=10)) == n
            d.clear(partition)
