"""Timers on an injected clock. The controller's service and membership read the time from a
`clock` (a callable returning seconds; `time.monotonic` by default) and set every timer of
theirs (waiting gets, paced puts, lease expiry, warehouse grace, heartbeats) through `Timers`,
so a test can drive them with a clock it moves by hand instead of sleeping.

A timer is a loop timer for the time left on the clock; when it fires before the clock got
there (a clock that does not run by itself) it is set again for what is left. `run_due` runs at
once the timers whose time the clock has reached: whoever moves a clock by hand calls it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

Clock = Callable[[], float]

LATE = 0.001
"""Seconds a timer's loop timer is set past its time (see `Timers._arm`)."""


class Timer:
    __slots__ = ("when", "seq", "fn", "args", "handle", "_timers")

    def __init__(self, timers: Timers, when: float, seq: int, fn: Callable, args: tuple) -> None:
        self._timers, self.when, self.seq, self.fn, self.args = timers, when, seq, fn, args
        self.handle: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        self._timers._cancel(self)


class Timers:
    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._pending: set[Timer] = set()
        self._seq = itertools.count()

    def call_at(self, when: float, fn: Callable, *args: object) -> Timer:
        """Call fn(*args) once the clock reads `when` (from inside the running event loop)."""
        t = Timer(self, when, next(self._seq), fn, args)
        self._pending.add(t)
        self._arm(t)
        return t

    def call_later(self, delay: float, fn: Callable, *args: object) -> Timer:
        return self.call_at(self.clock() + delay, fn, *args)

    def run_due(self) -> int:
        """Run now, earliest first, every timer whose time the clock has reached; returns how many ran."""
        ran = 0
        while True:
            now = self.clock()
            due = [t for t in self._pending if t.when <= now]
            if not due:
                return ran
            t = min(due, key=lambda t: (t.when, t.seq))
            self._cancel(t)
            t.fn(*t.args)
            ran += 1

    def _arm(self, t: Timer) -> None:
        # (LATE: uvloop keeps its time in whole milliseconds and fires timers up to 1 ms before the clock
        # gets there; each such timer woke the loop twice, half of an idle controller's wake-ups)
        t.handle = asyncio.get_running_loop().call_later(max(0.0, t.when - self.clock()) + LATE, self._fire, t)

    def _fire(self, t: Timer) -> None:
        if t not in self._pending:
            return
        if self.clock() < t.when:  # (early: the clock is not the loop's, or the loop rounds)
            self._arm(t)
            return
        self._pending.discard(t)
        t.handle = None
        t.fn(*t.args)

    def _cancel(self, t: Timer) -> None:
        self._pending.discard(t)
        if t.handle is not None:
            t.handle.cancel()
            t.handle = None

    def __len__(self) -> int:
        return len(self._pending)


def seconds(x: float) -> str:
    """A duration as error messages print it: two significant digits, whole seconds from 100 up
    ("1 s" for 0.999997, "2.5 s", "0.05 s", "120 s")."""
    if x >= 100:
        return f"{x:.0f} s"
    return f"{float(f'{x:.2g}'):g} s"
