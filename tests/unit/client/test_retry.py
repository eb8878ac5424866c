"""retry: attempts at a daemon that cannot be reached, backed off, until a deadline or the client closes."""

from __future__ import annotations

import threading
import time

import pytest

from dockd.client.retry import retry
from dockd.errors import DockClosed, DockConnectionError


def refused(msg: str = "connection refused") -> DockConnectionError:
    e = DockConnectionError(msg)
    e.refused = True
    return e


class Attempts:
    """Fails with the given errors, in turn, then answers "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def never_stopped(seconds: float) -> bool:
    return threading.Event().wait(seconds)


def test_the_first_answer_after_failures_is_returned():
    attempt = Attempts(DockConnectionError("reset"), refused())
    assert retry(attempt, time.monotonic() + 30, "h:1", stopped=never_stopped) == "ok" and attempt.calls == 3


def test_giving_up_names_the_daemon_and_the_last_error():
    attempt = Attempts(*[DockConnectionError(f"reset {i}") for i in range(100)])
    with pytest.raises(DockConnectionError, match=r"cannot reach dockd at h:1 \(retried for .* attempts\): reset"):
        retry(attempt, time.monotonic() + 0.2, "h:1", stopped=never_stopped)
    assert 1 < attempt.calls < 100


def test_an_address_where_nothing_listens_is_given_up_after_refused_s():
    attempt = Attempts(*[refused() for _ in range(100)])
    with pytest.raises(DockConnectionError, match="each refused\\): nothing listens there"):
        retry(attempt, time.monotonic() + 30, "h:1", stopped=never_stopped, refused_s=0.2)


def test_one_answer_that_was_not_a_refusal_keeps_it_trying_until_the_deadline():
    attempt = Attempts(DockConnectionError("timed out"), *[refused() for _ in range(100)])
    with pytest.raises(DockConnectionError, match="attempts\\): connection refused"):
        retry(attempt, time.monotonic() + 0.3, "h:1", stopped=never_stopped, refused_s=0.0)


def test_a_client_closed_while_it_waits_stops_retrying():
    waits: list[float] = []
    attempt = Attempts(*[DockConnectionError("reset") for _ in range(3)])

    def stopped(seconds: float) -> bool:
        waits.append(seconds)
        return len(waits) == 2

    with pytest.raises(DockClosed, match="closed while reconnecting"):
        retry(attempt, time.monotonic() + 30, "h:1", stopped=stopped)
    assert attempt.calls == 2 and waits == [0.05, 0.1]  # (backing off: 50 ms, then twice that)
