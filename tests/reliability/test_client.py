"""A client never desynchronises or leaks (finding 5): an interrupted call drops its
connection and gives back what it was granted, cancelling one coroutine leaves the
others alone, descriptors are closed on every path, and values that cannot come back
as they went in are refused."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

import dockd
from tests.conftest import serving, wait_child, wait_until

pytestmark = pytest.mark.timeout(180)


def test_ctrl_c_during_a_blocking_get_leaves_the_client_usable_and_nothing_leased(cluster, partition, client):
    code = """
import signal, sys, threading, time, torch, dockd
address, part = sys.argv[1], sys.argv[2]
d = dockd.connect(address)
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.5)
try:
    d.get("c", ["x"], 4, partition=part)       # blocks: nothing is there yet
except KeyboardInterrupt:
    print("interrupted", flush=True)
# the same client, the same pool: the next calls are answered in step
d.put({"x": torch.arange(4)}, partition=part)
print(d.get("c", ["x"], 4, partition=part, timeout=10).indexes)
"""
    out = client(code, cluster.address, partition)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "interrupted"
    assert lines[1].startswith("[0, 1, 2, 3]")  # in step, and the abandoned get holds none of the samples


def test_an_interrupt_right_after_a_lease_was_granted_gives_the_lease_back(cluster, dock, partition):
    """The reply carrying a lease is lost to an interrupt: the client releases it by the acquire's token."""
    dock.put({"x": torch.arange(4)}, partition=partition)
    with dockd.connect(cluster.address) as d:
        real_call = d._router.controller

        def interrupted(call, **kw):
            real_call(call, **kw)  # the controller granted the lease and sent the reply...
            raise KeyboardInterrupt  # ...and the caller never saw it

        d._router.controller = interrupted
        with pytest.raises(KeyboardInterrupt):
            d.acquire("c", ["x"], 4, partition=partition, timeout=10)
        d._router.controller = real_call
        progress = d.stats()["partitions"][partition]["consumers"]["c"]
        assert (progress["taken"], progress["leased"], progress["ready"]) == (0, 0, 4)
        assert d.get("c", ["x"], 4, partition=partition, timeout=10).indexes == [0, 1, 2, 3]


def test_cancelling_one_coroutine_leaves_the_others_alone(cluster, partition):
    async def main():
        async with await dockd.connect_async(cluster.address, max_concurrency=8) as adock:
            async def busy(k: int) -> int:
                n = 0
                for i in range(30):
                    await adock.put({"y": [k, i]}, partition=partition)
                    await adock.stats()
                    n += 1
                return n

            workers = [asyncio.ensure_future(busy(k)) for k in range(3)]
            for _ in range(20):  # gets that block and are cancelled, while the others use the pool
                stuck = asyncio.ensure_future(adock.get("never", ["nope"], 1, partition=partition))
                await asyncio.sleep(0.01)
                stuck.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await stuck
            assert await asyncio.gather(*workers) == [30, 30, 30]
            got = await adock.get("r", ["y"], 90, partition=partition, timeout=10)
            assert len(got) == 90

    asyncio.run(main())


def test_a_connection_closed_mid_call_keeps_its_descriptor_until_the_call_ends(cluster, partition):
    """Closing a connection another thread waits on must not free its descriptor number under
    that thread's poll(): a new socket would take the number and the call would wait on it
    forever. The close only shuts the socket down; the waiting call wakes and releases it."""
    from dockd._proto import dockd_pb2 as pb
    from dockd.net.connection import Connection

    host, port = cluster.address.rsplit(":", 1)
    conn = Connection(host, int(port))
    fd = conn.sock.fileno()
    real_poll, seen = conn._poll.poll, {}

    def poll(ms):  # runs inside the blocked call: close from "another thread", then open a socket
        conn.close()
        with __import__("socket").socket() as s:
            seen["new_fd"] = s.fileno()
        return real_poll(2000)  # the old bug: waits here on whatever now holds the number

    conn._poll = type("P", (), {"poll": staticmethod(poll)})()
    req = pb.AcquireRequest(partition=partition, consumer="c", count=1, timeout=30)
    req.columns.append("x")
    with pytest.raises(dockd.DockClosed):
        conn.call(pb.Frame(acquire=req))
    assert seen["new_fd"] != fd  # the number stayed taken while the call used it
    with pytest.raises(OSError):
        os.fstat(fd)  # and was released when the call returned


def test_descriptors_are_closed_on_every_path(cluster, partition):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    big = torch.ones(4, 1 << 16, dtype=torch.int32)  # values passed by descriptor
    with dockd.connect(cluster.address, warehouse=0) as d:
        d.put({"x": big}, partition=partition)
        d.get("warm", ["x"], 4, partition=partition, timeout=10)  # pools and connections exist now
        base = len(os.listdir("/proc/self/fd"))
        for i in range(20):
            got = d.get(f"c{i}", ["x"], 4, partition=partition, timeout=10)  # zero-copy results: no descriptor kept
            del got
            with pytest.raises(dockd.DockNotFound):
                d.read(partition, [99], ["x"])
            with pytest.raises(dockd.DockTimeout):
                d.get(f"c{i}", ["x"], 1, partition=partition, timeout=0)
        assert len(os.listdir("/proc/self/fd")) <= base + 2


@pytest.mark.parametrize("value", [(1, 2), {1, 2}, frozenset([3]), {"a": (1,)}, [[1, (2,)]]])
def test_values_that_would_change_type_are_refused(dock, partition, value):
    with pytest.raises(dockd.DockTypeError, match="would come back as a list"):
        dock.put({"x": [value]}, partition=partition)


def test_a_client_used_in_a_forked_child_says_so_and_the_parent_goes_on(cluster, partition):
    """A Dock used after os.fork() (a DataLoader worker handed the dataset's client) shares its parent's
    sockets, and two processes reading one socket mix up their answers. The child's call raises
    DockClosed saying what to do (it went out over the parent's connections before); closing the
    client there leaves the parent's connections alone; a client made in the child works."""
    import json

    with dockd.connect(cluster.address) as d:
        d.put({"x": torch.arange(8)}, partition=partition)
        assert d.get("c", ["x"], 2, partition=partition, timeout=10).indexes == [0, 1]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # (reports through the pipe, and leaves without running the parent's exit code)
            try:
                try:
                    d.get("c", ["x"], 2, partition=partition, timeout=10)
                    out = "the child used its parent's client"
                except dockd.DockClosed as e:
                    out = str(e)
                d.close()
                with dockd.connect(cluster.address) as mine:
                    out += "|" + json.dumps(mine.get("c", ["x"], 2, partition=partition, timeout=10).indexes)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = f"{type(e).__name__}: {e}"
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            out = f.read()
        assert "is a fork of it" in out and "dockd.connect" in out, out
        child = json.loads(out.split("|")[1])
        assert len(child) == 2
        rest = d.get("c", ["x"], 4, partition=partition, timeout=10).indexes  # (over the parent's own connections)
        assert sorted([0, 1, *child, *rest]) == list(range(8))


def test_a_child_forked_while_other_threads_held_the_clients_locks_does_not_hang(cluster, partition):
    """A DataLoader forks its workers while the parent's other threads work: a lock one of them held at
    that moment (the id pool's, the receive pool's) stays held in the child, whose own client then
    waited on it for ever. The child takes fresh locks; its client puts and gets (a 2 MiB reply over
    TCP, through the receive pool) and the child exits."""
    from dockd import _lazy, ids
    from dockd.net import recv_pool

    with dockd.connect(cluster.address) as d:
        d.put({"x": torch.arange(4)}, partition=partition)
        held = [ids._lock, recv_pool.recv_pool()._lock, recv_pool._POOL_LOCK, _lazy._lock]
        for lock in held:  # as other threads of this process hold them at the moment of the fork
            lock.acquire()
        try:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.environ["DOCKD_TRANSPORT"] = "tcp"
                    with dockd.connect(cluster.address) as mine:
                        mine.put({"big": torch.ones(1, 2 << 20, dtype=torch.uint8)}, partition=partition + "-big")
                        got = mine.get("c", ["big"], 1, partition=partition + "-big", timeout=10)
                        code = 0 if int(got.stacked("big").sum()) == 2 << 20 else 2
                        del got  # (its buffer goes back to the receive pool)
                finally:
                    os._exit(code)
        finally:
            for lock in held:
                lock.release()
        assert wait_child(pid, 60, "the forked child hung on a lock its parent's threads held at the fork") == 0
        assert d.get("c", ["x"], 4, partition=partition, timeout=10).indexes == [0, 1, 2, 3]


_GET_AND_GO = """
import asyncio, gc, os, signal, sys, dockd
import dockd.client.confirm, dockd.client.get
# (the get's confirm waits for the client to go: no early confirm after a slow get, no flusher within the hour)
dockd.client.get.CONFIRM_NOW_AFTER_S = dockd.client.confirm.CONFIRM_DELAY_S = 3600.0
address, part, how = sys.argv[1:]
if how == "async":
    async def main():
        adock = await dockd.connect_async(address)
        print((await adock.get("c", ["x"], 4, partition=part, timeout=30)).indexes, flush=True)
    asyncio.run(main())  # the AsyncDock is dropped, never closed
    sys.exit(0)
d = dockd.connect(address)
print(d.get("c", ["x"], 4, partition=part, timeout=30).indexes, flush=True)
if how == "del":
    del d
    gc.collect()
    os._exit(0)  # (no exit handlers: only the collection can have confirmed)
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
# "exit": falls off the end of the script without close()
"""


@pytest.mark.parametrize("how", ["exit", "del", "async"])
def test_a_script_that_leaves_without_close_confirms_what_its_get_returned(cluster, partition, client, how):
    """Finding 8: a script that gets and exits without close() (or drops its Dock, or its AsyncDock)
    left its samples unconfirmed, and the next client with that consumer name received them again.
    Now the confirm goes out at interpreter exit and when the Dock is collected."""
    with dockd.connect(cluster.address) as d:
        d.put({"x": torch.arange(8)}, partition=partition)
        out = client(_GET_AND_GO, cluster.address, partition, how)
        assert out.stdout.split("\n")[0] == "[0, 1, 2, 3]", out.stdout + out.stderr
        assert "could not confirm" not in out.stderr, out.stderr
        progress = d.stats()["partitions"][partition]["consumers"]["c"]
        assert (progress["taken"], progress["leased"]) == (4, 0), progress
        assert d.get("c", ["x"], 8, partition=partition, timeout=5, allow_partial=True).indexes == [4, 5, 6, 7]


def test_a_killed_client_still_has_its_samples_handed_out_again(cluster, partition, client):
    """Unchanged by the confirm at exit: a client killed (SIGKILL) before its confirm went out
    never received its samples for good, so the next get of the consumer receives them."""
    with dockd.connect(cluster.address) as d:
        d.put({"x": torch.arange(8)}, partition=partition)
        out = client(_GET_AND_GO, cluster.address, partition, "sigkill", check=False)
        assert out.returncode == -9 and out.stdout.split("\n")[0] == "[0, 1, 2, 3]", out.stdout + out.stderr
        wait_until(lambda: d.stats()["partitions"][partition]["consumers"]["c"]["leased"] == 0, 30,
                   "the killed client's lease to end")
        assert d.get("c", ["x"], 8, partition=partition, timeout=10).indexes == list(range(8))


def test_a_stopped_controller_does_not_hold_up_the_exit(partition, client):
    """The confirm at exit is bounded (CLOSE_CONFIRM_S): with the controller stopped (SIGSTOP) the
    script still exits, saying what it could not confirm. Resumed, the controller holds no lease of
    it: each sample is taken (it read the confirm the script left) or ready again."""
    code = """
import atexit, sys, time
stopped = []
atexit.register(lambda: print(f"exit took {time.monotonic() - stopped[0]:.1f}s", flush=True))  # runs last
import os, signal, dockd, dockd.client.confirm, dockd.client.get
dockd.client.get.CONFIRM_NOW_AFTER_S = dockd.client.confirm.CONFIRM_DELAY_S = 3600.0
d = dockd.connect(sys.argv[1])
print(d.get("c", ["x"], 4, partition=sys.argv[2], timeout=30).indexes, flush=True)
os.kill(int(sys.argv[3]), signal.SIGSTOP)
stopped.append(time.monotonic())
"""
    with serving("--controller", "--port", "0") as (address, proc):
        try:
            with dockd.connect(address) as d:
                d.put({"x": torch.arange(4)}, partition=partition)
            out = client(code, address, partition, str(proc.pid), timeout=60)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        lines = out.stdout.strip().splitlines()
        assert lines[0] == "[0, 1, 2, 3]" and lines[-1].startswith("exit took"), out.stdout + out.stderr
        assert float(lines[-1].split()[2][:-1]) < 10, lines[-1]  # CLOSE_CONFIRM_S (2 s) and some slack
        assert "could not confirm the samples of 1 get(s)" in out.stderr, out.stderr
        with dockd.connect(address) as d:
            progress = wait_until(lambda: (p := d.stats()["partitions"][partition]["consumers"]["c"])["leased"] == 0
                                  and p, 30, "the exited client's lease to end")
            assert progress["taken"] + progress["ready"] == 4, progress
