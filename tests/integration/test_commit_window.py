"""Puts answered before their commit (`dockd serve --commit-window`): a warehouse takes new indexes from
blocks its controller grants ahead, answers a put once it is stored and sends the commits in windows.
What must hold: the writer sees its own puts at once (read-your-writes), other clients once the window
is applied; a seal or a clear while commits wait loses nothing acknowledged and keeps nothing cleared;
a node that cannot keep the promise refuses the option at start; one with a data dir keeps it. Real daemons on loopback: a
controller with a state dir and no warehouse, and one warehouse joined to it."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch

import dockd
from dockd.local import spawn_node
from tests.conftest import scrape, value, wait_until


@contextlib.contextmanager
def _dock(tmp_path, window: float, *, state: bool = True, data: bool = False):
    """A controller (state dir, no warehouse) and one warehouse with --commit-window `window` (and a
    --data-dir: `data`): (address, the warehouse's metrics port)."""
    args = ["--controller", "--no-warehouse", "--port", "0"]
    if state:
        args += ["--state-dir", str(tmp_path / "state")]
    procs = []
    try:
        ctrl, ready = spawn_node(args)
        procs.append(ctrl)
        address = f"127.0.0.1:{ready['port']}"
        wh, wready = spawn_node(["--join", address, "--port", "0", "--capacity", "1GiB", "--metrics-port", "0",
                                 "--commit-window", str(window), *(["--data-dir", str(tmp_path / "data")] * data)])
        procs.append(wh)
        yield address, wready["metrics_port"]
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(20)
            p.stdout.close()


def _before_commit(metrics_port: int) -> float:
    return value(scrape(metrics_port), "dockd_puts_before_commit_total")


def _put_until_uncommitted(d, partition: str, metrics_port: int, start: int = 0) -> list[int]:
    """Put one sample at a time until the warehouse answers one before its commit (the first put of a
    partition asks for a block and is answered after its commit); the ids put."""
    before, ids = _before_commit(metrics_port), []
    for i in range(start, start + 200):
        d.put({"id": [i], "x": [torch.full((4,), float(i))]}, partition=partition)
        ids.append(i)
        if _before_commit(metrics_port) > before:
            return ids
    raise AssertionError("no put was answered before its commit")


def _ready(address: str, partition: str) -> int:
    """Samples of `partition` with column "id" written, as another client sees them (a block's
    indexes are samples too, reserved: none of their columns is written until their commit)."""
    with dockd.connect(address) as other:
        return other.stats()["partitions"].get(partition, {}).get("columns", {}).get("id", 0)


def test_the_writer_sees_its_puts_at_once_and_others_once_the_window_is_applied(tmp_path):
    with _dock(tmp_path, window=8.0) as (address, mport), dockd.connect(address) as d:
        ids = _put_until_uncommitted(d, "rw", mport)
        assert _ready(address, "rw") == len(ids) - 1  # (another client: the last put's commit still waits)
        got = d.get("c", ["id", "x"], count=len(ids), partition="rw", timeout=10)  # (its own put: flushed first)
        assert sorted(int(v) for v in got["id"]) == ids
        for i, x in zip(got["id"], got["x"]):
            assert torch.equal(x, torch.full((4,), float(i)))


def test_other_clients_see_an_answered_put_once_its_window_goes(tmp_path):
    with _dock(tmp_path, window=0.2) as (address, mport), dockd.connect(address) as d:
        ids = _put_until_uncommitted(d, "later", mport)
        wait_until(lambda: _ready(address, "later") == len(ids), timeout=30, what="the window's commits applied")


def test_a_seal_takes_in_what_warehouses_answered_and_ends_their_blocks(tmp_path):
    with _dock(tmp_path, window=8.0) as (address, mport), dockd.connect(address) as d:
        ids = _put_until_uncommitted(d, "sealed", mport)
        with dockd.connect(address) as other:
            other.seal("sealed")  # (its handshake makes the warehouse send the waiting commits first)
            got = other.get("c", ["id"], count=1000, partition="sealed", allow_partial=True, timeout=10)
            assert sorted(int(v) for v in got["id"]) == ids
            with pytest.raises(dockd.DockDrained):
                other.get("c", ["id"], count=1, partition="sealed", timeout=10)
        with pytest.raises(dockd.DockError, match="sealed"):
            d.put({"id": [-1], "x": [torch.zeros(4)]}, partition="sealed")


def test_a_clear_while_commits_wait_frees_their_values_and_keeps_none(tmp_path):
    with _dock(tmp_path, window=8.0) as (address, mport), dockd.connect(address) as d:
        _put_until_uncommitted(d, "cleared", mport)
        with dockd.connect(address) as other:
            other.clear("cleared")
        wait_until(lambda: value(scrape(mport), "dockd_warehouse_used_bytes") == 0, timeout=30,
                   what="the cleared partition's values freed")
        d.put({"id": [7], "x": [torch.zeros(4)]}, partition="cleared")  # (a partition of the same name, afresh)
        got = d.get("c", ["id"], count=1000, partition="cleared", allow_partial=True, timeout=10)
        assert [int(v) for v in got["id"]] == [7]


def test_without_a_state_dir_puts_are_answered_after_their_commit(tmp_path):
    with _dock(tmp_path, window=8.0, state=False) as (address, mport), dockd.connect(address) as d:
        for i in range(20):
            d.put({"id": [i]}, partition="plain")
        assert _before_commit(mport) == 0
        assert _ready(address, "plain") == 20


@pytest.mark.parametrize("extra, needle", [
    (["--join", "127.0.0.1:1", "--commit-window", "-1"], "between 0 and 10"),
    (["--controller", "--no-warehouse"], "is a warehouse's"),
])
def test_a_commit_window_a_node_cannot_keep_is_refused_at_start(tmp_path, extra, needle):
    args = ["--commit-window", "0.05", *extra]
    proc = subprocess.run([sys.executable, "-m", "dockd", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert needle in proc.stderr


def test_a_warehouse_with_a_data_dir_answers_puts_before_their_commit(tmp_path):
    """(The kill -9 tests are tests/reliability/test_commit_window_data_dir.py.)"""
    with _dock(tmp_path, window=8.0, data=True) as (address, mport), dockd.connect(address) as d:
        ids = _put_until_uncommitted(d, "kept", mport)
        got = d.get("c", ["id", "x"], count=len(ids), partition="kept", timeout=10)
        assert sorted(int(v) for v in got["id"]) == ids


def test_a_killed_warehouse_takes_what_it_answered_with_it_and_its_blocks_end(tmp_path):
    """Without a data dir a warehouse's uncommitted answers die with it, as its stored values do; the
    rest of its blocks is deleted once the controller declares it lost, so a seal then goes through."""
    ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--state-dir", str(tmp_path / "s"),
                              "--warehouse-grace", "1"])
    address = f"127.0.0.1:{ready['port']}"
    procs = [ctrl]
    try:
        wh, wready = spawn_node(["--join", address, "--port", "0", "--capacity", "1GiB", "--metrics-port", "0",
                                 "--commit-window", "8"])
        procs.append(wh)
        with dockd.connect(address) as d:
            ids = _put_until_uncommitted(d, "lost", wready["metrics_port"])
        wh.kill()
        wh.wait(20)
        other, _ = spawn_node(["--join", address, "--port", "0", "--capacity", "1GiB"])  # (a dock needs one)
        procs.append(other)
        with dockd.connect(address) as d:
            def sealed() -> bool:
                try:
                    d.seal("lost")
                except dockd.DockError:
                    return False  # (the owner is away, not yet declared lost: the seal names it)
                return True
            wait_until(sealed, timeout=60, what="a seal once the killed owner is declared lost")
            p = d.stats()["partitions"]["lost"]
            assert p["sealed"]
            # what is left: the samples committed before the kill (every put but the last); the block's
            # unwritten rest, and the answered put it never committed, were deleted with it
            assert p["samples"] - p["deleted"] == len(ids) - 1 == p["columns"]["id"]
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
            proc.stdout.close()
