"""Versioned weights in the dock (dockd.weights) on real daemons: publish, the ready fence, reading,
keeping k versions, readers holding versions back, capacity, a publisher killed mid-publish."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

import dockd
from dockd.weights import Publication
from dockd.weights.buckets import raw_bytes
from tests.conftest import run_client, wait_until


def model(step: int, n: int = 6, size: int = 3000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {f"layer{i}.weight": torch.randn(size, generator=g).bfloat16() for i in range(n)}
    out["head.bias"] = torch.randn(17, generator=g)
    out["big"] = torch.randn(40_000, generator=g)  # 160 kB: split over buckets of 64 KiB
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return list(got) == list(want) and all(
        g.dtype == w.dtype and g.shape == w.shape and torch.equal(raw_bytes(g), raw_bytes(w))
        for g, w in zip(got.values(), want.values()))


@pytest.fixture
def name() -> str:
    return f"m{uuid.uuid4().hex[:8]}"


def test_publish_and_read_bit_exact(dock, name):
    p0 = dock.publish_weights(model(0).items(), model=name, bucket_size=64 << 10)
    p1 = dock.publish_weights(model(1).items(), model=name, bucket_size=64 << 10)
    assert (p0.version, p1.version) == (0, 1) and p1.buckets > 3 and p1.tensors == len(model(1))
    with dock.weights_reader(name) as r:
        assert r.versions() == [0, 1] and r.latest() == 1
        assert same(dict(r.read()), model(1)) and r.last == 1
        assert same(dict(r.read(version=0)), model(0))
        assert r.last_read["buckets"] == p0.buckets and r.last_read["bytes"] == p0.stored
    with pytest.raises(dockd.DockValueError, match="already published"):
        dock.publish_weights(model(2).items(), model=name, version=1)


def test_a_version_is_visible_only_once_complete(dock, name):
    dock.publish_weights(model(0).items(), model=name, bucket_size=64 << 10)
    pub = Publication(dock, model=name, bucket_size=64 << 10)
    for k, t in model(1).items():
        pub.add(k, t)
    assert pub.samples, "buckets were put before the fence"
    with dock.weights_reader(name) as r:
        assert r.latest() == 0 and same(dict(r.read()), model(0))
        with pytest.raises(dockd.DockTimeout, match="no version >= 1"):
            r.resolve(after=0, timeout=0.3)
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(r.read(after=0, timeout=30)))
        t.start()
        pub.finish()
        t.join(30)
        assert not t.is_alive() and same(got, model(1)) and r.last == 1


def test_keep_k_and_a_reader_holds_back_until_it_passes_or_its_hold_ends(dock, name):
    slow = dock.weights_reader(name)  # registered before the first publish: holds every version back
    fast = dock.weights_reader(name)
    for step in range(4):
        dock.publish_weights(model(step, n=1).items(), model=name, keep=2, hold=3.0)
        dict(fast.read())
    assert fast.versions() == [0, 1, 2, 3]  # slow has read none of them
    dict(slow.read(version=1))  # slow passes 0 and 1
    assert slow.versions() == [2, 3]
    dock.publish_weights(model(4, n=1).items(), model=name, keep=2, hold=3.0)
    assert slow.versions() == [2, 3, 4]  # 2 is held back by slow
    assert wait_until(lambda: fast.table.retire(keep=2, hold_s=3.0), timeout=20, what="the hold to end") == [2]
    assert slow.versions() == [3, 4]
    slow.close()
    fast.close()


def test_weights_count_against_capacity():
    with dockd.start_local(num_warehouses=1, capacity="4MiB") as c, dockd.connect(c.address) as d:
        tensors = {"w": torch.zeros(400_000)}  # 1.6 MB per version
        d.publish_weights(tensors.items(), model="cap", keep=1)
        assert d.stats()["warehouses"][0]["bytes"] >= 1_600_000
        with pytest.raises(dockd.DockFull):  # 3 MB more does not fit next to the 1.6 MB kept: waits, then fails
            d.publish_weights({"w": torch.zeros(750_000)}.items(), model="cap", keep=1, bucket_size=1 << 20,
                              timeout=0.5)
        d.publish_weights(tensors.items(), model="cap", keep=1, timeout=10)  # the version of the failed publish
        d.publish_weights(tensors.items(), model="cap", keep=1, timeout=10)  # fits once the older one is retired
        with d.weights_reader("cap") as r:
            assert r.versions() == [2]


def test_publisher_killed_mid_publish_leaves_readers_on_the_previous_version(cluster, dock, name):
    dock.publish_weights(model(0).items(), model=name, bucket_size=64 << 10)
    run_client("""
        import os, sys, torch, dockd
        from dockd.weights import Publication
        d = dockd.connect(sys.argv[1])
        pub = Publication(d, model=sys.argv[2], bucket_size=64 << 10)
        for i in range(5):
            pub.add(f"t{i}", torch.ones(30_000))
        assert len(pub.samples) >= 3
        os._exit(0)  # killed before the fence
    """, cluster.address, name)
    with dock.weights_reader(name) as r:
        assert r.versions() == [0] and same(dict(r.read()), model(0))
    assert f"dockd.weights/{name}/v1" in dock.stats()["partitions"]
    p = dock.publish_weights(model(1).items(), model=name, bucket_size=64 << 10)
    assert p.version == 1
    with dock.weights_reader(name) as r:
        assert same(dict(r.read()), model(1))


def test_delta_versions_are_small_and_rebuilt_bit_exact(dock, name):
    from dockd.weights import Publisher

    g = torch.Generator().manual_seed(3)
    w = {f"w{i}": torch.randn(20_000, generator=g).bfloat16() for i in range(4)}
    w["bias"] = torch.randn(10, generator=g)
    steps = []
    for step in range(6):
        if step:
            w = {k: v.clone() for k, v in w.items()}
            for v in w.values():  # 1 % of the values move
                flat = v.view(-1)
                pos = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
                flat[pos] = torch.randn(len(pos), generator=g).to(v.dtype)
        steps.append(w)
    every = dock.weights_reader(name)
    pub = Publisher(dock, name, delta=True, full_every=3, keep=2, bucket_size=64 << 10)
    sizes = []
    for step, tensors in enumerate(steps):
        p = pub.publish(tensors.items())
        sizes.append(p.stored)
        assert p.base == (None if step % 3 == 0 else step - 1)
        assert same(dict(every.read(after=every.last) if every.last is not None else every.read()), tensors)
        assert every.last_read["base"] == p.base
    full = sizes[0]
    for step in (1, 2, 4, 5):  # 1 % changed: 6 bytes per changed bf16 value, 10 per fp32 one
        assert sizes[step] < 0.1 * full, sizes
    fresh = dock.weights_reader(name)  # no version read yet: rebuilds version 5 from version 3 (whole) and 4
    assert same(dict(fresh.read(version=5)), steps[5])
    assert fresh.versions() == [3, 4, 5]  # keep=2, and 3 stays as the base of 4
    every.close()
    fresh.close()
