"""The events a Dock's finalizers set (its flusher's wake-up, its stop) may be set from inside their own
`set`: a finalizer runs inside whatever allocation its thread makes, and `Condition.notify` allocates
while it holds the event's lock."""

from __future__ import annotations

import threading

from dockd.client.dock import FinalizerEvent


def test_an_event_set_inside_its_own_lock_does_not_deadlock_and_wakes_its_waiter():
    ev = FinalizerEvent()
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: ev.wait(10) and woke.set(), daemon=True)
    waiter.start()

    def set_inside_the_lock() -> None:
        with ev._cond:  # (as inside `set`'s notify, where a collection may run a finalizer that sets it)
            ev.set()

    t = threading.Thread(target=set_inside_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a set inside the event's lock deadlocked"
    assert woke.wait(10) and ev.is_set()
    ev.clear()
    assert not ev.wait(0.01)
