"""How long a same-host call spins for its reply (`dockd.net.reply_waits.ReplyWaits`): a bit more than
its kind of request's replies typically take, within the cap (DOCKD_SPIN_US); not at all for a kind
whose replies take longer than the cap, so a client waiting for a large put or a waiting get leaves
the CPU to the daemon instead of spinning on it."""

from __future__ import annotations

import pytest

from dockd.net.reply_waits import ReplyWaits

CAP = 1e-3


def test_a_kind_not_seen_yet_spins_the_cap_and_a_quick_one_a_bit_more_than_its_replies_take():
    w = ReplyWaits(CAP)
    assert w.spin("ping") == CAP
    for _ in range(20):
        w.waited("ping", 100e-6)
    assert 100e-6 < w.spin("ping") < 300e-6
    assert w.spin("put") == CAP  # kinds are learnt apart


def test_a_kind_whose_replies_take_longer_than_the_cap_does_not_spin_and_spins_again_once_they_are_quick():
    w = ReplyWaits(CAP)
    for _ in range(5):
        w.waited("put", 3e-3)
    assert w.spin("put") == 0.0
    for _ in range(20):
        w.waited("put", 200e-6)
    assert w.spin("put") == pytest.approx(200e-6 * ReplyWaits.SPIN_MARGIN + ReplyWaits.SPIN_SLACK_S, rel=0.05)


def test_one_long_wait_stops_the_spin_for_a_few_calls_at_most():
    w = ReplyWaits(CAP)
    for _ in range(20):
        w.waited("acquire", 150e-6)
    w.waited("acquire", 60.0)  # a get that waited a minute for data
    stopped = 0
    while w.spin("acquire") == 0.0:
        stopped += 1
        assert stopped < 10
        w.waited("acquire", 150e-6)
    assert 0 < w.spin("acquire") <= CAP


def test_no_spin_where_the_transport_never_spins():
    w = ReplyWaits(0.0)
    assert w.spin("fetch") == 0.0
    w.waited("fetch", 50e-6)
    assert w.spin("fetch") == 0.0


def quiet_calls(w: ReplyWaits) -> int:
    n = 0
    while w.spin("put") == 0.0:
        n += 1
        assert n <= ReplyWaits.QUIET_CALLS[1]
    return n


def test_spins_in_vain_stop_the_spin_for_more_calls_each_time_and_a_spin_that_gets_its_reply_starts_over():
    """A spin whose reply came long after it ran out, or during which the thread lost its CPU, only
    delayed the reply (the daemon it waits for shares the CPU): 8 calls without a spin, then 16, 32 ...
    up to 256; a spin that gets its reply in time starts the count at 8 again."""
    w = ReplyWaits(CAP)
    w.waited("put", 200e-6)
    assert w.spin("put") > 0
    got = []
    for _ in range(7):
        w.spun(False)
        got.append(quiet_calls(w))
    assert got == [8, 16, 32, 64, 128, 256, 256]
    w.spun(True)
    w.spun(False)
    assert quiet_calls(w) == 8
