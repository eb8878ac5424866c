"""How long a same-host call spins for the start of its reply (`ReplyWaits`), learnt per connection.

On a small machine waking a process asleep in the kernel costs tens of microseconds on each side, so a
call polls its socket for a while before it sleeps; how long, and when not at all, is decided here
(docs/design.md, "Same-host clients spin briefly before sleeping")."""

from __future__ import annotations

import time
from typing import Final


class ReplyWaits:
    """How long a connection spins for a reply, learnt from how long its replies took, by kind of
    request: a bit more than the kind's typical wait (SPIN_MARGIN times it, and SPIN_SLACK_S), within
    `cap` (the transport's `spin_s`); not at all for a kind whose replies typically take longer than
    `cap` (a large put, a get that waits for data): there a spin only takes the CPU from the daemon
    it waits for, and the call sleeps in poll at once. A kind not seen yet spins `cap`.

    A spin whose reply came long after it ran out (more than half the spin later: had the daemon been
    working meanwhile, it would have been about done), or during which the calling thread was off its
    CPU for most of the time (`spun`), only delayed the reply: most often the daemon the call waits for
    shares this CPU and runs only once the spin ends (or preempts it). The calls after such a spin do
    not spin, 8 of them after one, twice as many after each further one (up to 256), and one that
    gets its reply while spinning starts that count again. On a 2-core VM a warm 1 MiB put with client
    and daemon on one CPU took 830 us spinning and 680 us not; on separate CPUs a spin saves the
    daemon's wake-up on each call."""

    SPIN_MARGIN: Final = 1.5
    SPIN_SLACK_S: Final = 30e-6
    WEIGHT: Final = 0.25  # of each new wait in the moving average
    LOST_S: Final = 20e-6  # off the CPU for more than this (and half the spin) during a spin: it lost its CPU
    QUIET_CALLS: Final = (8, 256)  # calls that do not spin after a spin in vain: at first, and at most

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self._typical: dict[str | None, float] = {}
        self._quiet = 0  # calls left that do not spin
        self._backoff = self.QUIET_CALLS[0]  # ... after the next spin in vain

    def spun(self, replied: bool) -> None:
        """A spin ended: with its reply (the thread on its CPU meanwhile), or in vain."""
        if replied:
            self._backoff = self.QUIET_CALLS[0]
        else:
            self._quiet = self._backoff
            self._backoff = min(2 * self._backoff, self.QUIET_CALLS[1])

    def spin(self, kind: str | None) -> float:
        """Seconds to spin for the reply to a request of `kind`."""
        if self._quiet:
            self._quiet -= 1
            return 0.0
        typical = self._typical.get(kind)
        if typical is None:
            return self.cap
        return 0.0 if typical > self.cap else min(self.cap, typical * self.SPIN_MARGIN + self.SPIN_SLACK_S)

    def waited(self, kind: str | None, seconds: float) -> None:
        """A reply to a request of `kind` started to arrive `seconds` after it was sent. Each wait
        counts as at most 4 x cap, so one long wait stops the spin for a few calls at most."""
        seconds = min(max(seconds, 0.0), 4 * self.cap)
        typical = self._typical.get(kind)
        self._typical[kind] = seconds if typical is None else typical + (seconds - typical) * self.WEIGHT


def on_cpu(began: float, cpu0: float) -> bool:
    """Whether the calling thread kept its CPU through a spin that began at `began` (monotonic) with its
    CPU time at `cpu0`: off it for most of the spin, something else wanted that CPU."""
    wall = time.monotonic() - began
    return wall - (time.thread_time() - cpu0) <= max(ReplyWaits.LOST_S, wall / 2)
