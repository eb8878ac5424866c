"""Commits applied as runs (`dockd/controller/commit_runs.py`), under SIGKILLs of the controller: eight
writer threads put one sample each, then write a second column of it by index, as fast as they can, to
one warehouse, so its link carries several commits per message and the controller applies them as runs,
journaled as one record each (`M` for new samples, `I` for column writes); the controller (with a state
dir, no warehouse of its own) is SIGKILLed and started again four times meanwhile. Every acknowledged put
and column write must come out exactly once with its own value; one that raised may come out once or not
at all; nothing else comes. Real `dockd serve` processes on loopback.

The same with the warehouse started with `--commit-window 0.05`: it answers each put once stored, with
indexes from blocks the controller granted ahead, and sends their commits in windows, so windows of answered
puts wait for the restarted controller and go with the warehouse's rejoin (a column write by index, answered
after its commit, may reach the controller before its sample's windowed commit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import dockd
from dockd.controller.records import read
from dockd.local import read_ready
from tests.conftest import scrape, value

pytestmark = pytest.mark.slow

WRITERS = 8
KILLS = 4
PARTITION = "runs"


def _spawn(args: list[str], log) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "dockd", "--log-level", "INFO", "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=log,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, read_ready(proc, timeout=60)


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(20)
    if p.stdout is not None:
        p.stdout.close()


@pytest.mark.parametrize("window", [0.0, 0.05], ids=["answered-after-commit", "commit-window"])
def test_every_acknowledged_put_comes_out_once_while_runs_of_commits_meet_controller_kills(tmp_path, window):
    state = str(tmp_path / "state")
    log = open(tmp_path / "daemons.log", "ab")  # noqa: SIM115 - closed below
    ctrl_args = ["--controller", "--no-warehouse", "--state-dir", state, "--warehouse-grace", "60"]
    ctrl, ready = _spawn([*ctrl_args, "--port", "0"], log)
    address = f"127.0.0.1:{ready['port']}"
    wh, wready = _spawn(["--join", address, "--capacity", "1GiB", "--port", "0", "--metrics-port", "0",
                         "--commit-window", str(window)], log)
    acked: dict[int, int] = {}  # id -> index
    raised: set[int] = set()
    written: set[int] = set()  # ids whose column "r" was written (acknowledged)
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            with dockd.connect(address) as d:
                i = t * 10_000_000
                while not stop.is_set():
                    i += 1
                    try:
                        idx = d.put({"id": [i], "x": [torch.full((16,), float(i))]}, partition=PARTITION,
                                    timeout=60)
                    except dockd.DockError:
                        with lock:
                            raised.add(i)
                        continue
                    with lock:
                        acked[i] = idx[0]
                    try:
                        d.put({"r": [torch.tensor([float(-i)], dtype=torch.float64)]}, partition=PARTITION,
                              indexes=idx, timeout=60)
                    except dockd.DockError:
                        continue
                    with lock:
                        written.add(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(WRITERS)]
    try:
        for t in threads:
            t.start()
        for _ in range(KILLS):
            time.sleep(1.5)
            _kill(ctrl)
            ctrl, _ = _spawn([*ctrl_args, "--port", address.rsplit(":", 1)[1]], log)
        time.sleep(2.0)  # (puts since the last restart: their runs are in the journal it writes now)
        stop.set()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        kinds = [rec[0] for name in sorted(os.listdir(state)) if name.startswith("journal-")
                 for rec, _ in read(tmp_path / "state" / name)]
        early = value(scrape(wready["metrics_port"]), "dockd_puts_before_commit_total")
        if window:
            assert early > len(acked) / 2, f"only {early} of {len(acked)} puts were answered before their commit"
        else:
            assert early == 0
            assert "M" in kinds and "I" in kinds, "no run of commits of each kind was journaled after the last restart"
        got: dict[int, int] = {}
        with dockd.connect(address) as d:
            while True:  # (until nothing more comes: a put that raised may have come too)
                try:
                    b = d.get("check", ["id", "x"], 512, partition=PARTITION, allow_partial=True,
                              timeout=2 if len(got) >= len(acked) else 30)
                except dockd.DockTimeout:
                    break
                for k, x, index in zip(b["id"], b["x"], b.indexes):
                    assert k not in got, f"id {k} came twice (indexes {got[k]} and {index})"
                    assert torch.equal(x, torch.full((16,), float(k))), f"id {k} came with another value"
                    got[k] = index
        missing = sorted(set(acked) - set(got))
        assert not missing, f"{len(missing)} acknowledged ids never came: {missing[:8]}"
        rewards: set[int] = set()
        with dockd.connect(address) as d:  # (another consumer: the samples whose column r was written)
            while True:
                try:
                    b = d.get("check-r", ["id", "r"], 512, partition=PARTITION, allow_partial=True,
                              timeout=2 if len(rewards) >= len(written) else 30)
                except dockd.DockTimeout:
                    break
                for k, r in zip(b["id"], b["r"]):
                    assert k not in rewards and float(r[0]) == -k, f"id {k}: column r twice, or another value"
                    rewards.add(k)
        assert written <= rewards <= set(acked), (len(written), len(rewards))
        assert {k: got[k] for k in acked} == acked  # each acknowledged id, at the index its put was told
        assert set(got) <= set(acked) | raised
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for p in (ctrl, wh):
            if p.poll() is None:
                _kill(p)
        log.close()
