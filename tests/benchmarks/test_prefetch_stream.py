"""The streaming benchmark's pacing and child environment (no process started)."""

from __future__ import annotations

import threading

import pytest

from benchmarks.prefetch_stream import REPO_ROOT, Pacer, child_env


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_pacer_spaces_calls_at_the_rate():
    clock = FakeClock()
    pacer = Pacer(80, clock=clock, sleep=clock.sleep)
    for _ in range(5):
        pacer.wait()
    assert clock.slept == pytest.approx([1 / 80] * 4)  # the first at once, then one slot per 1/80 s
    assert clock.now == pytest.approx(100.0 + 4 / 80)


def test_pacer_catches_up_a_late_caller_without_sleeping():
    clock = FakeClock()
    pacer = Pacer(10, clock=clock, sleep=clock.sleep)
    pacer.wait()
    clock.now += 0.35  # a slow put: slots 1, 2, 3 are past
    for _ in range(3):
        pacer.wait()
    assert clock.slept == []
    pacer.wait()  # slot 4 at +0.4
    assert clock.slept == pytest.approx([0.05])


def test_pacer_rate_zero_never_waits():
    clock = FakeClock()
    pacer = Pacer(0, clock=clock, sleep=clock.sleep)
    for _ in range(100):
        pacer.wait()
    assert clock.slept == []


def test_pacer_gives_threads_distinct_slots():
    pacer = Pacer(1000, clock=lambda: 0.0, sleep=lambda s: None)
    slots: list[float] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(250):
            s = pacer.slot()
            with lock:
                slots.append(s)

    ts = [threading.Thread(target=take) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(slots) == [k / 1000 for k in range(1000)]


def test_child_env_puts_the_tree_first_and_ignores_the_working_directory(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env("/tmp/some-tree")
    assert env["PYTHONPATH"].split(":") == ["/tmp/some-tree", str(REPO_ROOT), "/elsewhere"]
    assert env["PYTHONSAFEPATH"] == "1"
    assert child_env(None)["PYTHONPATH"].split(":") == [str(REPO_ROOT), "/elsewhere"]
