"""--commit-window with --data-dir (issue 44): a put answered before its commit is in its data dir file
(fsync'd, keeping its commit) when it is answered, so a warehouse SIGKILLed before its window went out,
and started again on the same dir, commits it with its first registration: every acknowledged sample is
delivered once, with its values, and a seal then drains. The same when the controller (with a state
dir) is killed too, whichever comes back first. Real `dockd serve` processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import dockd
from dockd.local import read_ready, spawn_node
from dockd.warehouse.put import WRITE_OFF_LOOP
from tests.conftest import scrape, value, wait_until

pytestmark = pytest.mark.timeout(180)

WINDOW = "8"  # seconds: no window goes out before the kill


class _Dock:
    """A controller with a state dir (no warehouse), and one warehouse with a data dir and a commit window;
    either is killed and started again at the address it had."""

    def __init__(self, tmp_path, grace: float = 30.0) -> None:
        self.state, self.data = str(tmp_path / "state"), str(tmp_path / "data")
        self.grace = grace
        self.ctrl_port = 0
        self.ctrl: subprocess.Popen | None = None
        self.wh: subprocess.Popen | None = None
        self.metrics_port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ctrl_port}"

    def start_controller(self) -> None:
        self.ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", str(self.ctrl_port),
                                       "--state-dir", self.state, "--warehouse-grace", str(self.grace)])
        self.ctrl_port = ready["port"]

    def launch_warehouse(self) -> None:
        """Start the warehouse (its ready line comes once it has joined: `joined`)."""
        args = ["--join", self.address, "--port", "0", "--capacity", "256MiB", "--metrics-port", "0",
                "--data-dir", self.data, "--commit-window", WINDOW]
        self.wh = subprocess.Popen([sys.executable, "-m", "dockd", "serve", *args], stdout=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL)

    def joined(self) -> None:
        assert self.wh is not None
        self.metrics_port = read_ready(self.wh)["metrics_port"]

    def kill(self, proc: subprocess.Popen | None) -> None:
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()

    def close(self) -> None:
        for p in (self.wh, self.ctrl):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
            if p is not None and p.stdout is not None and not p.stdout.closed:
                p.stdout.close()


@pytest.fixture
def dock(tmp_path):
    d = _Dock(tmp_path)
    try:
        d.start_controller()
        d.launch_warehouse()
        d.joined()
        yield d
    finally:
        d.close()


def _before_commit(d: _Dock) -> float:
    return value(scrape(d.metrics_port), "dockd_puts_before_commit_total")


BIG_ID = 10_000  # the id of a put big enough to be written off the event loop (WRITE_OFF_LOOP)


def _x(i: int) -> torch.Tensor:
    n = WRITE_OFF_LOOP // 4 + 1024 if i == BIG_ID else 16
    return torch.arange(n, dtype=torch.float32) + 1000 * i


def _put_answered_early(d: _Dock, partition: str, puts: int) -> list[int]:
    """Puts of two samples each, until `puts` of them were answered before their commit; the ids put."""
    ids: list[int] = []
    with dockd.connect(d.address) as c:
        for _ in range(puts + 200):
            if _before_commit(d) >= puts:
                return ids
            pair = [len(ids), len(ids) + 1]
            c.put({"id": pair, "x": [_x(i) for i in pair]}, partition=partition)
            ids += pair
    raise AssertionError(f"fewer than {puts} puts were answered before their commit")


def _delivered_once(address: str, partition: str, ids: list[int]) -> None:
    """Every sample of `ids` is handed out exactly once, with its values; then the partition seals and drains."""
    got: list[int] = []
    with dockd.connect(address) as c:
        def more() -> bool:
            try:
                b = c.get("c", ["id", "x"], count=len(ids) - len(got), partition=partition, allow_partial=True,
                          timeout=1)
            except dockd.DockTimeout:
                return False  # (none ready yet)
            for i, x in zip(b["id"], b["x"]):
                assert torch.equal(x, _x(int(i))), f"sample id={int(i)} came back with other values"
                got.append(int(i))
            return len(got) >= len(ids)
        wait_until(more, timeout=60, what="every acknowledged sample handed out")
        assert sorted(got) == ids  # (each once: none lost, none twice)
        c.seal(partition)
        with pytest.raises(dockd.DockDrained):
            c.get("c", ["id"], count=1, partition=partition, timeout=10)


def test_a_killed_warehouse_restarted_on_its_data_dir_commits_what_it_answered_before_its_commit(dock):
    ids = _put_answered_early(dock, "early", puts=10)
    dock.kill(dock.wh)  # (its window of 8 s had not gone out: the controller has none of those commits)
    dock.launch_warehouse()
    dock.joined()
    _delivered_once(dock.address, "early", ids)


def test_a_big_put_answered_before_its_commit_comes_back_after_a_kill(dock):
    """A put of WRITE_OFF_LOOP bytes or more has its body written and flushed off the event loop, then its
    header; it is answered only then."""
    ids = _put_answered_early(dock, "big", puts=1)
    with dockd.connect(dock.address) as c:
        before = _before_commit(dock)
        c.put({"id": [BIG_ID], "x": [_x(BIG_ID)]}, partition="big")
        assert _before_commit(dock) == before + 1
    dock.kill(dock.wh)
    dock.launch_warehouse()
    dock.joined()
    _delivered_once(dock.address, "big", ids + [BIG_ID])


@pytest.mark.parametrize("first", ["controller", "warehouse"])
def test_both_killed_lose_nothing_whichever_comes_back_first(dock, first):
    ids = _put_answered_early(dock, "both", puts=10)
    dock.kill(dock.wh)
    dock.kill(dock.ctrl)
    if first == "controller":
        dock.start_controller()
        dock.launch_warehouse()
    else:
        dock.launch_warehouse()  # (it waits for its controller, its answered puts' commits kept)
        dock.start_controller()
    dock.joined()
    _delivered_once(dock.address, "both", ids)


def test_a_second_kill_after_the_commits_went_sends_none_twice(dock):
    """Commits answered before a kill are recorded in the data dir (`committed`): a restart sends none of
    them again, and what the first restart committed comes through a second kill and restart too."""
    ids = _put_answered_early(dock, "twice", puts=6)
    dock.kill(dock.wh)
    dock.launch_warehouse()
    dock.joined()
    with dockd.connect(dock.address) as c:  # (the first restart's registration applied them)
        wait_until(lambda: c.stats()["partitions"]["twice"]["columns"].get("id", 0) == len(ids), timeout=30,
                   what="the recovered commits applied")
    parts = [p for p in os.listdir(dock.data) if p.startswith("p-")]
    assert any(os.path.exists(os.path.join(dock.data, p, "committed")) for p in parts)
    dock.kill(dock.wh)
    dock.launch_warehouse()
    dock.joined()
    _delivered_once(dock.address, "twice", ids)


def test_a_warehouse_back_after_its_grace_finds_its_uncommitted_puts_cleared(tmp_path):
    """What stays lost: a warehouse that does not come back within --warehouse-grace is retired and its
    blocks dropped, deleting their unwritten samples (its answered puts whose commits had not gone out
    among them); at its late rejoin those commits are answered cleared and it frees their values."""
    dock = _Dock(tmp_path, grace=1.0)
    try:
        dock.start_controller()
        dock.launch_warehouse()
        dock.joined()
        ids = _put_answered_early(dock, "late", puts=4)
        used = value(scrape(dock.metrics_port), "dockd_warehouse_used_bytes")
        dock.kill(dock.wh)
        with dockd.connect(dock.address) as c:
            wait_until(lambda: all(w["state"] == "lost" for w in c.stats()["warehouses"].values()), timeout=30,
                       what="the killed warehouse retired")
        dock.launch_warehouse()
        dock.joined()
        committed = len(ids) // 2 - 4  # (puts of two samples; the first waited for the block, its commit first)
        wait_until(lambda: value(scrape(dock.metrics_port), "dockd_warehouse_used_bytes")
                   == used * committed / (len(ids) // 2), timeout=30,
                   what="the values of the puts whose commits were cleared freed")
        _delivered_once(dock.address, "late", ids[: 2 * committed])
    finally:
        dock.close()


def _restart(d: _Dock) -> None:
    d.kill(d.wh)
    d.launch_warehouse()
    d.joined()


def test_puts_answered_after_a_restart_that_reuses_file_numbers_come_back_from_the_next_kill(dock):
    """Files of early puts committed and then deleted leave their numbers in the partition's `committed`
    record; a restart gives those numbers to its next files (the highest file left is lower), and those
    puts, answered before their commit and killed before it went out, must be sent again by the next
    restart, not taken as committed."""
    with dockd.connect(dock.address) as c:
        first = c.put({"id": [-2, -1], "x": [_x(-2), _x(-1)]}, partition="reuse")  # (a file that stays)
    ids = _put_answered_early(dock, "reuse", puts=4)
    _restart(dock)  # (their commits go with its registration, and are recorded committed)
    with dockd.connect(dock.address) as c:
        wait_until(lambda: c.stats()["partitions"]["reuse"]["columns"].get("id", 0) == len(ids) + 2, timeout=30,
                   what="the recovered commits applied")
        b = c.get("c", ["id"], count=len(ids) + 2, partition="reuse", timeout=10)
        gone = [int(i) for i, v in zip(b.indexes, b["id"]) if int(v) >= 0]
        assert c.delete("reuse", gone) == len(ids)  # (their files are removed)
    _restart(dock)
    again = _put_answered_early(dock, "reuse", puts=4)  # (in files numbered as the deleted ones were)
    _restart(dock)
    with dockd.connect(dock.address) as c:
        def all_there() -> bool:
            return c.stats()["partitions"]["reuse"]["columns"].get("id", 0) == len(again) + len(first)
        wait_until(all_there, timeout=30, what="every acknowledged put of the last run committed")
