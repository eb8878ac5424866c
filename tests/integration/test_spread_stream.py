"""Puts and gets of a spread partition (``--shards NAME=S``): the client puts new samples to its home
shard (dockd.client.spread.home: by its home warehouse) and gets from its home shard first, then from the others, so
one stream's metadata is spread over S controllers. What must hold: the indexes a put returns name
its shard (index % S) and are the stream's, every sample is taken once by a consumer's clients, a
get waiting on its home shard is served by samples that land on another, a sealed stream drains,
read-your-writes holds under --commit-window, and what a spread partition cannot serve is refused.
Real daemons on loopback: two nodes, each a controller and a warehouse."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading

import pytest

import dockd
from dockd import owners
from dockd.client import spread
from dockd.client.options import GetOptions
from dockd.data import StreamingDataset
from dockd.errors import DockDrained, DockTimeout, DockValueError
from dockd.local import free_ports, spawn_node

pytestmark = pytest.mark.timeout(180)

SPREAD = {"stream": 2, "ahead": 2, "wait": 2, "sealed": 2, "refused": 2, "empty": 2}


@pytest.fixture(scope="module")
def cluster():
    with dockd.start_local(2, controllers=2, shards=SPREAD) as c:
        yield c


@pytest.fixture
def writers(cluster):
    """A client on each warehouse, by its home shard (of 2)."""
    docks = [dockd.connect(cluster.address, warehouse=w) for w in cluster.warehouses]
    try:
        by_shard = {spread.home(d.home, 2, 2): d for d in docks}
        assert set(by_shard) == {0, 1}, f"the warehouses' ids {[d.home for d in docks]} name one shard only"
        yield by_shard
    finally:
        for d in docks:
            d.close()


def _put(writer, partition: str, n: int, tag: str) -> dict[int, str]:
    """n samples put one by one; index -> value."""
    out = {}
    for i in range(n):
        idx = writer.put({"v": [f"{tag}-{i}"]}, partition=partition)
        out[idx[0]] = f"{tag}-{i}"
    return out


def _taken(batch, into: dict[int, str]) -> None:
    assert batch.partition in SPREAD
    for i, v in zip(batch.indexes, batch["v"]):
        assert i not in into, f"sample {i} taken twice"
        into[i] = v


def _seal(dock, partition: str) -> None:
    for k in range(SPREAD[partition]):
        dock.seal(owners.shard_name(partition, k, SPREAD[partition]))


def test_writers_put_to_their_home_shard_and_two_consumers_take_every_sample_once(cluster, writers):
    written: dict[int, str] = {}
    for k, w in writers.items():
        got = _put(w, "stream", 6, f"w{k}")
        assert all(i % 2 == k for i in got), (k, sorted(got))  # (the writer's home shard)
        written.update(got)
    assert len(written) == 12
    taken: dict[int, str] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def consume():
        try:
            with dockd.connect(cluster.address) as d:
                while True:
                    with lock:
                        if len(taken) >= len(written):
                            return
                    try:
                        b = d.get("c", ["v"], 3, partition="stream", timeout=0.2, allow_partial=True)
                    except DockTimeout:
                        continue
                    with lock:
                        _taken(b, taken)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert taken == written
    with dockd.connect(cluster.address) as d, pytest.raises(DockTimeout, match="spread over 2 shards|none had"):
        d.get("c", ["v"], 1, partition="stream", timeout=0)


def test_prefetch_and_async_gets_take_each_sample_once_across_shards(cluster, writers):
    written: dict[int, str] = {}
    for k, w in writers.items():
        written.update(_put(w, "ahead", 5, f"w{k}"))
    taken: dict[int, str] = {}
    d = writers[0]
    for _ in range(4):
        _taken(d.get("c", ["v"], 2, partition="ahead", timeout=10, prefetch=3), taken)
    windows = d._getter._ahead._windows  # (kept under the shard's name: a window is one controller's leases)
    assert windows and all(owners.SHARD_MARK in key for key in windows), list(windows)

    async def one():
        async with await dockd.connect_async(cluster.address) as a:
            return await a.get("c", ["v"], 1, partition="ahead", timeout=10)

    _taken(asyncio.run(one()), taken)
    while len(taken) < len(written):
        _taken(d.get("c", ["v"], 1, partition="ahead", timeout=10, prefetch=3), taken)
    assert taken == written


def test_a_get_waiting_on_its_home_shard_is_served_by_samples_put_to_the_other(cluster, writers, monkeypatch):
    consumer = writers[0]
    waiting = threading.Event()
    frame = GetOptions.frame

    def watched(opts, home):  # (the get waits on shard 0, its home shard, once a pass found nothing)
        if opts.timeout and opts.partition == owners.shard_name("wait", 0, 2):
            waiting.set()
        return frame(opts, home)

    monkeypatch.setattr(GetOptions, "frame", watched)  # (an acquire's frame: the compiled Acquirer cannot be patched)
    got: list = []
    t = threading.Thread(target=lambda: got.append(consumer.get("c", ["v"], 2, partition="wait", timeout=60)))
    t.start()
    assert waiting.wait(30)
    written = _put(writers[1], "wait", 2, "late")
    t.join(60)
    assert got, "the get did not return"
    b = got[0]
    assert b.partition == "wait" and dict(zip(b.indexes, b["v"])) == written
    assert all(i % 2 == 1 for i in b.indexes)


def test_a_sealed_stream_of_groups_drains_through_a_streaming_dataset(cluster, writers):
    written: dict[int, str] = {}
    for k, w in writers.items():
        for g in range(3):
            pair = [f"w{k}-{g}-0", f"w{k}-{g}-1"]
            idx = w.put({"v": pair}, partition="sealed", group_size=2)
            assert [i % 2 for i in idx] == [k, k]  # (a group is one shard's)
            written.update(zip(idx, pair))
    _seal(writers[0], "sealed")
    taken: dict[int, str] = {}
    for batch in StreamingDataset(cluster.address, "c", ["v"], 4, partition="sealed", groups=True, timeout=30,
                                  prefetch=2):
        for i, v in zip(batch["indexes"], batch["v"]):
            assert i not in taken
            taken[i] = v
        assert len(batch["indexes"]) % 2 == 0 and len({v.rsplit("-", 1)[0] for v in batch["v"]}) * 2 == len(batch["v"])
    assert taken == written  # (it ended: every shard drained)
    with pytest.raises(DockDrained, match="all its 2 shards"):
        writers[1].get("c", ["v"], 1, partition="sealed", timeout=5)


def test_what_a_spread_partition_cannot_serve_is_refused_and_leases_are_the_shards(writers):
    d = writers[1]
    idx = d.put({"v": ["a", "b"]}, partition="refused")
    with pytest.raises(DockValueError, match="put each shard's indexes apart; index % 2 is the shard"):
        d.put({"w": [1, 2]}, partition="refused", indexes=[idx[0], idx[0] + 1])
    d.put({"w": [1, 2]}, partition="refused", indexes=idx)  # (one shard's samples: columns added)
    for ranks in ({"dp_rank": 0, "dp_size": 2}, {"mp_group": (0, 0, 2)}):
        with pytest.raises(DockValueError, match="rank-aware gets .* one controller; use an ordinary partition"):
            d.get("c", ["v"], 1, partition="refused", timeout=0, **ranks)
        with pytest.raises(DockValueError, match="rank-aware"):
            d.acquire("c", ["v"], 1, partition="refused", timeout=0, **ranks)
    with pytest.raises(DockValueError, match="prefer_local"):
        d.get("c", ["v"], 1, partition="refused", timeout=0, prefer_local=True)
    lease = d.acquire("c", ["v", "w"], 2, partition="refused", timeout=5)
    assert lease.partition == owners.shard_name("refused", 1, 2)
    assert [i * 2 + 1 for i in lease.indexes] == idx
    assert d.fetch(lease) == {"v": ["a", "b"], "w": [1, 2]}
    d.confirm(lease)
    with pytest.raises(DockTimeout, match="spread partition 'refused' over 2 shards: none had 1"):
        d.get("c", ["v"], 1, partition="refused", timeout=0)


def test_a_get_of_nothing_ready_times_out_after_its_timeout(writers):
    with pytest.raises(DockTimeout, match="spread partition 'empty' over 2 shards: none had 4 samples ready"):
        writers[0].get("c", ["v"], 4, partition="empty", timeout=0.6)


@contextlib.contextmanager
def _windowed(tmp_path):
    """Two controllers (each with a state dir: they grant blocks of indexes) with --shards rw=2, and a
    warehouse with --commit-window 0.05 joined to them: (a controller's address, the warehouse's)."""
    ports = free_ports("127.0.0.1", 2)
    listed = ",".join(f"127.0.0.1:{p}" for p in ports)
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET=secrets.token_hex(32))
    procs = []
    try:
        for k, port in enumerate(ports):
            procs.append(spawn_node(["--controller", "--no-warehouse", "--port", str(port), "--controllers", listed,
                                     "--shards", "rw=2", "--state-dir", str(tmp_path / f"state-{k}")], env=env)[0])
        wh, ready = spawn_node(["--join", f"127.0.0.1:{ports[0]}", "--port", "0", "--capacity", "1GiB",
                                "--commit-window", "0.05"], env=env)
        procs.append(wh)
        yield f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ready['port']}"
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(20)
            p.stdout.close()


def test_the_writer_sees_its_puts_under_a_commit_window(tmp_path):
    with _windowed(tmp_path) as (address, warehouse), dockd.connect(address, warehouse=warehouse) as d:
        shard = owners.shard_name("rw", spread.home(d.home, 2, 2), 2)
        written: dict[int, int] = {}
        for i in range(200):  # (until one put is answered before its commit: the first asks for a block)
            written[d.put({"v": [i]}, partition="rw")[0]] = i
            if shard in d._router._unflushed:  # (recorded under the shard: the partition its warehouse commits to)
                break
        else:
            raise AssertionError("no put was answered before its commit")
        b = d.get("c", ["v"], len(written), partition="rw", timeout=0)  # (its own puts: flushed first)
        assert dict(zip(b.indexes, b["v"])) == written
