"""A warehouse's data dir on a full disk, with and without --commit-window: samples consumed there are
freed (the `deleted` record that cannot be appended to does not fail the free), the warehouse keeps
serving, a restart on the full disk is refused naming the fix, and once there is room the warehouse
comes back (SIGKILLed before) with every acknowledged sample delivered exactly once, none consumed before
delivered again. Real `dockd serve` processes on loopback; the data dir on a small tmpfs mounted for the
test (root only: skipped without)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import dockd
from dockd.local import spawn_node
from tests.conftest import wait_until
from tests.reliability.test_state_dir_full import _fill

pytestmark = pytest.mark.timeout(240)

ROW = 4096  # float32 values a sample: 16 KiB, four to a put


SMALL_FS = "2m"  # (the tmpfs of the small_fs fixture, tests/reliability/conftest.py)


class _Dock:
    """A controller with a state dir (no warehouse) and one warehouse with its data dir on the small tmpfs."""

    def __init__(self, tmp_path, data: str, *extra: str) -> None:
        self.data, self.extra = data, list(extra)
        self.ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--state-dir",
                                       str(tmp_path / "state"), "--warehouse-grace", "60"])
        self.address = f"127.0.0.1:{ready['port']}"
        self.wh: subprocess.Popen | None = None
        self.port = "0"

    def warehouse_args(self) -> list[str]:
        return ["--join", self.address, "--port", self.port, "--capacity", "64MiB", "--data-dir", self.data,
                *self.extra]

    def start_warehouse(self) -> None:
        self.wh, ready = spawn_node(self.warehouse_args())
        self.port = str(ready["port"])

    def kill_warehouse(self) -> None:
        assert self.wh is not None and self.wh.stdout is not None
        self.wh.send_signal(signal.SIGKILL)
        self.wh.wait(10)
        self.wh.stdout.close()

    def close(self) -> None:
        for p in (self.wh, self.ctrl):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
            if p is not None and p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def docks():
    made: list[_Dock] = []
    yield lambda *a: made.append(_Dock(*a)) or made[-1]
    for d in made:
        d.close()


def _used(d: dockd.Dock) -> int:
    (w,) = d.stats()["warehouses"].values()
    return int(w["bytes"])


@pytest.mark.parametrize("window", [False, True], ids=["commit", "commit-window"])
def test_consumed_samples_are_freed_on_a_full_data_dir_and_a_restart_delivers_the_rest_once(tmp_path, small_fs,
                                                                                            docks, window):
    """Puts fill most of the disk, a filler the rest; a consumer retires 1.5 puts' worth of samples, so the
    half-consumed put's delete must be recorded beside its file, on the full disk. Before, that append
    raised into the free: the controller's free failed (and was sent again, to free nothing), the
    retired puts stayed in memory and on the disk, and it never got room back."""
    dock = docks(tmp_path, str(small_fs / "wh"), *(["--commit-window", "0.05"] if window else []))
    dock.start_warehouse()
    with dockd.connect(dock.address, reconnect_timeout=60) as d:
        d.create_partition("p", retire_when_consumed_by=["c"])
        acked: dict[int, float] = {}
        for k in range(6):  # (six puts of 64 KiB on the 2 MiB disk)
            idx = d.put({"x": torch.arange(4 * k, 4 * k + 4, dtype=torch.float32)[:, None].expand(4, ROW)},
                        partition="p")
            acked.update({i: float(4 * k + j) for j, i in enumerate(idx)})
        wait_until(lambda: d.stats()["partitions"]["p"]["columns"].get("x") == 24, 20, "the commits to be applied")
        filler = _fill(small_fs)
        with pytest.raises(dockd.DockStateFull, match="Free room there"):
            d.put({"x": torch.zeros(4, ROW)}, partition="p")
        before = _used(d)
        got: dict[int, float] = {}
        b = d.get("c", ["x"], 6, partition="p", timeout=10)
        got.update({i: float(v[0]) for i, v in zip(b.indexes, b["x"])})
        wait_until(lambda: _used(d) <= before - 6 * ROW * 4, 20, "the consumed samples to be freed on the full disk")
        b = d.get("c", ["x"], 2, partition="p", timeout=10)  # (it keeps serving)
        got.update({i: float(v[0]) for i, v in zip(b.indexes, b["x"])})

        dock.kill_warehouse()
        proc = subprocess.run([sys.executable, "-m", "dockd", "serve", *dock.warehouse_args()], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and "free room on that disk" in proc.stderr, proc.stderr[-2000:]
        os.unlink(filler)
        dock.start_warehouse()
        b = d.get("c", ["x"], len(acked) - len(got), partition="p", timeout=20)
        assert not set(b.indexes) & set(got), sorted(set(b.indexes) & set(got))  # none consumed before, again
        got.update({i: float(v[0]) for i, v in zip(b.indexes, b["x"])})
        assert got == acked
        with pytest.raises(dockd.DockTimeout):
            d.get("c", ["x"], 1, partition="p", timeout=1)
