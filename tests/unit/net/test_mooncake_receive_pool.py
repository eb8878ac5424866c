"""The Mooncake client's receive buffers (`dockd.net.mooncake_engine.ReceivePool`): reused by size class within
their budget, the others unregistered, and given back (a finalizer) without waiting for the pool's lock. The
engine here only records registrations: the pool's own bookkeeping is what is tested."""

from __future__ import annotations

import threading

from dockd.net.mooncake_engine import ReceivePool

MiB = 1 << 20


class _Registrations:
    def __init__(self) -> None:
        self.live: set[int] = set()

    def register_memory(self, addr: int, size: int) -> int:
        self.live.add(addr)
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.live.remove(addr)
        return 0


def test_a_buffer_given_back_inside_the_lock_waits_for_no_lock_and_is_settled_by_the_next_take():
    engine = _Registrations()
    pool = ReceivePool(engine, budget=4 * MiB)
    a, b = pool.take(4 * MiB), pool.take(4 * MiB)
    assert len(engine.live) == 2 and pool.lent_bytes == 8 * MiB

    def given_back_under_the_lock() -> None:
        with pool._lock:
            pool.give(*a)
            pool.give(*b)

    t = threading.Thread(target=given_back_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a give-back inside the lock deadlocked"
    assert pool.lent_bytes == 8 * MiB  # (not settled yet: the lock was held)
    again = pool.take(4 * MiB)  # settles both: one idle within the budget (taken again here), one unregistered
    assert again[1] == a[1] and engine.live == {a[1]}
    assert pool.lent_bytes == 4 * MiB and pool.idle_bytes == 0
    pool.give(*again)  # (the lock free: settled at once)
    assert pool.idle_bytes == 4 * MiB and pool.lent_bytes == 0 and engine.live == {a[1]}
