"""The guarantee rows under abuse with --commit-window (puts answered before their commit): the controller's
state dir full when the commits of puts answered already come in, and a producer or a consumer that leaves
without closing (os._exit in a child process). Real `dockd serve` processes on loopback; the state dir on a
small tmpfs mounted for the test (root only: skipped without)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import dockd
from dockd.local import spawn_node
from tests.conftest import wait_until
from tests.reliability.test_state_dir_full import _fill

pytestmark = pytest.mark.timeout(240)

SMALL_FS = "2m"  # (the tmpfs of the small_fs fixture, tests/reliability/conftest.py)


class _Dock:
    """A controller with a state dir, one warehouse (with a data dir when given) answering puts before their
    commit (`window` seconds)."""

    def __init__(self, state: str, window: str, data: str = "") -> None:
        self.ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--state-dir", state])
        self.address = f"127.0.0.1:{ready['port']}"
        self.wh, _ = spawn_node(["--join", self.address, "--port", "0", "--capacity", "64MiB",
                                 "--commit-window", window, *(["--data-dir", data] if data else [])])

    def close(self) -> None:
        for p in (self.wh, self.ctrl):
            if p.poll() is None:
                p.terminate()
                p.wait(20)
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def docks():
    made: list[_Dock] = []
    yield lambda *a: made.append(_Dock(*a)) or made[-1]
    for d in made:
        d.close()


def _read_once(d: dockd.Dock, partition: str, want: dict[int, int], wait: float = 60) -> None:
    got: dict[int, int] = {}

    def more() -> bool:
        try:
            b = d.get("c", ["id"], len(want) - len(got), partition=partition, allow_partial=True, timeout=1)
        except dockd.DockTimeout:
            return False
        for i, v in zip(b.indexes, b["id"]):
            assert i not in got, f"sample {i} handed out twice"
            got[i] = int(v)
        return len(got) >= len(want)

    wait_until(more, wait, "every acknowledged sample handed out")
    assert got == want


@pytest.mark.slow
def test_puts_answered_before_a_full_state_dir_are_kept_until_it_has_room(tmp_path, small_fs, docks):
    """A block granted before the state dir filled up: puts taking indexes from it are answered, and their
    commits then meet the full disk. They must wait for room, not be dropped: they were acknowledged."""
    dock = docks(str(small_fs / "state"), "0.05", str(tmp_path / "data"))
    with dockd.connect(dock.address) as d:
        acked: dict[int, int] = {}
        for k in range(4):  # (the block is granted with the first puts; the next ones take from it)
            acked[d.put({"id": [k]}, partition="w")[0]] = k
        wait_until(lambda: d.stats()["partitions"]["w"]["columns"].get("id") == 4, 20, "the first commits")
        filler = _fill(small_fs)
        refused = 0
        for k in range(4, 3000):  # (until the journal's space reserved ahead is used up: big records)
            try:
                acked[d.put({"id": [k], **{f"{c:04d}" + "c" * 200: [k] for c in range(k % 7 + 20)}},
                            partition="w")[0]] = k
            except dockd.DockStateFull:
                refused += 1  # (not acknowledged: nothing to deliver)
                if refused == 20:
                    break
        assert refused == 20, len(acked)
        os.unlink(filler)
        _read_once(d, "w", acked, wait=15)


_PRODUCER = """
import os, sys, torch, dockd
d = dockd.connect(sys.argv[1])
idx = d.put({"id": list(range(int(sys.argv[3]), int(sys.argv[3]) + 4))}, partition=sys.argv[2])
print(",".join(map(str, idx)), flush=True)
os._exit(0)  # (acknowledged; the client never closed, its window not gone out)
"""

_CONSUMER = """
import os, sys, dockd
d = dockd.connect(sys.argv[1])
b = d.get("c", ["id"], 3, partition=sys.argv[2], timeout=30)
print(",".join(map(str, b.indexes)), flush=True)
os._exit(0)  # (not confirmed, never closed)
"""


@pytest.mark.parametrize("window", ["0", "2"], ids=["commit", "commit-window"])
def test_a_producer_and_a_consumer_that_exit_without_closing(tmp_path, docks, window):
    """A producer's put acknowledged before it exits is delivered, once; a consumer's samples it never
    confirmed go to the next client of its name after the lease (at least once across a consumer's death),
    and no other sample twice."""
    dock = docks(str(tmp_path / "state"), window)
    want: dict[int, int] = {}
    for k in range(3):
        out = subprocess.run([sys.executable, "-c", _PRODUCER, dock.address, "p", str(4 * k)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        want.update({int(i): 4 * k + j for j, i in enumerate(out.stdout.strip().split(","))})
    out = subprocess.run([sys.executable, "-c", _CONSUMER, dock.address, "p"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    with dockd.connect(dock.address) as d:
        _read_once(d, "p", want)  # (the dead consumer's three come back once its lease is given up or confirmed)
