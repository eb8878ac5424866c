"""The weights relay on real daemons: each warehouse that serves a reader holds a version once, pulled
from the warehouse it was published to or from one that holds it already (a chain by default)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

import dockd
from dockd.weights import publish
from dockd.weights.buckets import raw_bytes
from dockd.weights.read import WeightsReader


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(50_000, generator=g).bfloat16() for i in range(8)}  # 800 kB


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return list(got) == list(want) and all(torch.equal(raw_bytes(got[k]), raw_bytes(want[k])) for k in want)


@pytest.fixture(scope="module")
def four():
    with dockd.start_local(num_warehouses=4, capacity="256MiB") as c:
        yield c


@pytest.fixture
def docks(four):
    """A client on each warehouse of `four` (its puts go there; its reads come from there)."""
    made = [dockd.connect(four.address, warehouse=w) for w in range(4)]
    yield made
    for d in made:
        d.close()


@pytest.fixture
def model() -> str:
    return f"m{uuid.uuid4().hex[:6]}"


def held_bytes(dock: dockd.Dock, wid: int) -> int:
    return dock._router.hello(wid).used


def test_each_warehouse_pulls_once_down_a_chain(docks, model):
    before = [held_bytes(docks[0], w) for w in range(4)]
    p = publish(docks[0], tensors(0).items(), model=model, bucket_size=128 << 10)
    assert p.buckets >= 6
    readers = [WeightsReader(docks[w], model) for w in (1, 2, 3, 3)]  # two readers on warehouse 3
    depths = []
    for r in readers:
        reading = r.open()
        assert same(dict(reading.tensors()), tensors(0))
        depths.append(reading.source().depth)
    assert depths == [1, 2, 3, 3]  # joined in this order: 0 -> 1 -> 2 -> 3
    grown = [held_bytes(docks[0], w) - before[w] for w in range(4)]
    for w in (1, 2, 3):  # one copy each, whatever the number of readers
        assert p.stored <= grown[w] < 2 * p.stored, grown
    origin_reader = WeightsReader(docks[0], model)
    assert same(dict(origin_reader.read()), tensors(0))


def test_readers_on_many_warehouses_at_once_and_a_tree(docks, model):
    publish(docks[0], tensors(1).items(), model=model, bucket_size=64 << 10, fanout=2)
    out: dict[int, dict] = {}
    depth: dict[int, int] = {}

    def read(w: int) -> None:
        reading = WeightsReader(docks[w], model).open()
        out[w] = {k: v.clone() for k, v in reading.tensors()}
        depth[w] = reading.source().depth

    threads = [threading.Thread(target=read, args=(w,)) for w in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(same(out[w], tensors(1)) for w in (1, 2, 3))
    assert sorted(depth.values()) == [1, 1, 2]  # fanout 2: the origin feeds two, one of them the third


def test_a_retired_version_is_freed_on_every_warehouse(docks, model):
    publish(docks[0], tensors(2).items(), model=model, keep=1)
    with WeightsReader(docks[2], model) as r:
        before = held_bytes(docks[0], 2)
        dict(r.read())
        assert held_bytes(docks[0], 2) > before + 800_000
        publish(docks[0], tensors(3).items(), model=model, keep=1)  # retires version 0 (r passed it)
        assert r.versions() == [1]
        assert held_bytes(docks[0], 2) < before + 4096  # its relay copy went with the clear (the reader's
        # registration, a sample of a few bytes, stays)
        assert same(dict(r.read()), tensors(3))


def test_a_client_cannot_send_relay_requests(four, raw):
    from dockd._proto import dockd_pb2 as pb

    r = raw(four.address)
    v = pb.WeightsVersion(partition="dockd.weights/x/v0", samples=[0], origin=pb.WarehouseInfo(id=0, host="h", port=1))
    reply = r.call(pb.Frame(id=1, weights_relay=pb.WeightsRelay(version=v, join=pb.WarehouseInfo(id=1))))
    assert reply.status.code == pb.WRONG_ROLE or reply.status.code == pb.AUTH, reply.status
    reply = r.call(pb.Frame(id=2, weights_wait=pb.WeightsWait(version=pb.WeightsVersion(partition="step-0"))))
    assert reply.status.code == pb.INVALID_ARGUMENT and "weights version" in reply.status.message


def test_a_dead_parent_is_replaced():
    with dockd.start_local(num_warehouses=3, capacity="256MiB") as c:
        docks = [dockd.connect(c.address, warehouse=w) for w in range(3)]
        try:
            publish(docks[0], tensors(4).items(), model="m", bucket_size=128 << 10)
            first = WeightsReader(docks[1], "m").open()
            dict(first.tensors())
            assert first.source().depth == 1  # warehouse 1 holds a copy: the next warehouse would pull from it
            proc = next(p for p, ready in zip(c.procs, c.nodes) if ready["warehouse"] == 1)
            proc.kill()
            proc.wait(10)
            second = WeightsReader(docks[2], "m").open()
            assert same({k: v.clone() for k, v in second.tensors()}, tensors(4))
            assert second.source().depth == 1  # the origin took it over from the dead warehouse
        finally:
            for d in docks[::2]:
                d.close()


def test_a_tensor_parallel_rank_reads_only_its_slices(docks, model):
    from dockd.resharding.layout import ParamSpec
    from dockd.weights.slices import reference

    g = torch.Generator().manual_seed(5)
    full = {"qkv": torch.randn(3 * 64, 64, generator=g).bfloat16(), "o": torch.randn(64, 64, generator=g),
            "norm": torch.randn(64, generator=g), "embed": torch.randn(5000, 64, generator=g)}  # 1.3 MB: split
    layout = {"qkv": ParamSpec(name="qkv", shape=(192, 64), dtype=torch.bfloat16, tp_dim=0, fused=(64, 64, 64)),
              "o": ParamSpec(name="o", shape=(64, 64), dtype=torch.float32, tp_dim=1),
              "embed": ParamSpec(name="embed", shape=(5000, 64), dtype=torch.float32, tp_dim=0)}
    publish(docks[0], full.items(), model=model, bucket_size=256 << 10)
    total = sum(t.nbytes for t in full.values())
    for rank in range(2):
        r = WeightsReader(docks[1], model)
        got = dict(r.read(tp=(rank, 2), layout=layout))
        for name, t in full.items():
            assert torch.equal(got[name], reference(t, layout.get(name), 2, rank)), (name, rank)
        assert r.last_read["bytes"] == (total - full["norm"].nbytes) // 2 + full["norm"].nbytes
        r.close()


def test_the_relay_reaches_the_origin_the_controller_names_not_the_clients(docks, model):
    publish(docks[0], tensors(6).items(), model=model, bucket_size=128 << 10)
    reading = WeightsReader(docks[1], model).open()
    reading.source().version.origin.port = 1  # a client's word for the origin's address is not followed
    assert same({k: v.clone() for k, v in reading.tensors()}, tensors(6))
