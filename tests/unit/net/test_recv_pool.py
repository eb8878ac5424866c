"""The client's pool of warm receive buffers (pure: no sockets)."""

from __future__ import annotations

import gc

from dockd.net.recv_pool import RecvPool

MiB = 1 << 20


def _address(view) -> int:
    return view.__array_interface__["data"][0]


def test_a_returned_block_is_reused_by_the_next_reply_of_its_size():
    pool = RecvPool(8 * MiB)
    v = pool.take(3 * MiB)
    addr = _address(v)
    del v
    gc.collect()
    assert pool.pooled >= 3 * MiB
    assert _address(pool.take(3 * MiB)) == addr


def test_the_last_block_stays_however_big_and_older_ones_make_room():
    pool = RecvPool(8 * MiB)
    small = [pool.take(2 * MiB) for _ in range(3)]
    del small
    gc.collect()
    assert pool.pooled == 6 * MiB
    big = pool.take(64 * MiB)  # a reply bigger than the whole pool
    addr = _address(big)
    del big
    gc.collect()
    assert pool.pooled == 64 * MiB  # the small blocks were dropped for it
    again = pool.take(64 * MiB)
    assert _address(again) == addr  # a steady stream of huge replies reads into warm memory
    assert pool.pooled == 0


def test_small_replies_bypass_the_pool():
    pool = RecvPool(8 * MiB)
    v = pool.take(RecvPool.MIN - 1)
    assert v.nbytes == RecvPool.MIN - 1
    del v
    gc.collect()
    assert pool.pooled == 0


def test_the_process_pool_is_made_on_first_use_with_the_environment_then(monkeypatch):
    """Importing the client reads no environment: the pool is sized by $DOCKD_RECV_POOL_BYTES as it
    is when the first large reply arrives."""
    from dockd.net import recv_pool as module

    monkeypatch.setattr(module, "_POOL", None)
    monkeypatch.setenv("DOCKD_RECV_POOL_BYTES", str(3 * MiB))
    pool = module.recv_pool()
    assert pool.max_bytes == 3 * MiB and module.recv_pool() is pool


def test_a_block_given_back_inside_the_lock_waits_for_no_lock_and_is_pooled_by_the_next_take():
    """The give-back is a finalizer: it runs inside any allocation of its thread, one made under the pool's
    lock included. It must not wait for that lock (the thread would deadlock on the lock it holds)."""
    import threading

    pool = RecvPool(8 * MiB)
    v = pool.take(3 * MiB)
    addr = _address(v)

    def given_back_under_the_lock() -> None:
        nonlocal v
        with pool._lock:
            del v
            gc.collect()

    t = threading.Thread(target=given_back_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a give-back inside the lock deadlocked"
    assert _address(pool.take(3 * MiB)) == addr
