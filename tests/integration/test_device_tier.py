"""The device tier (put(device="keep")) through real daemons.

On machines without an accelerator, DOCKD_CPU_DEVICE_TIER=1 makes the client treat CPU
tensors as device-resident: they are shared with the warehouse through torch's file-system
shared memory instead of CUDA IPC, and every other step is the one a GPU node runs (the
warehouse copies the writer's buffer into its own device-tier memory before answering,
counts it apart, spills it to host memory when the tier is full, shares it with same-node
readers that ask, copies it to host bytes for the others, frees it with its samples).
tests/gpu runs the same on CUDA memory.
"""

from __future__ import annotations

import importlib.util
import logging
import urllib.request

import pytest
import torch

import dockd
from tests.conftest import scrape, value

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tier(monkeypatch):
    monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "1")
    with dockd.start_local(1, capacity="64MiB", extra_args=["--device-capacity", "256KiB", "--metrics-port", "0"]) as c:
        yield c


def metric(cluster, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.nodes[0]['metrics_port']}/metrics", timeout=10).read()
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in the metrics")


def shared_bytes(cluster) -> int:
    return int(metric(cluster, "dockd_device_shared_bytes_total"))


def usage(d: dockd.Dock) -> tuple[int, int]:
    w = d.stats(traffic=True)["warehouses"][0]
    return w["bytes"], w["device_bytes"]


def sample_columns(n: int, k: int = 0):
    return {
        "x": torch.arange(n * 4, dtype=torch.float32).view(n, 4) + k,                 # batched
        "r": [torch.arange(i % 5 + 1, dtype=torch.bfloat16) + k for i in range(n)],    # ragged
        "uid": [f"s{k}-{i}" for i in range(n)],                                        # msgpack: host bytes
    }


def check(batch, n: int, k: int = 0) -> None:
    want = sample_columns(n, k)
    assert torch.equal(batch.stacked("x").cpu(), want["x"])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(batch["r"], want["r"]))
    assert batch["uid"] == want["uid"]


def test_keep_puts_into_the_device_tier_and_reads_back_bit_exact(tier):
    with dockd.connect(tier.address) as d:
        cols = sample_columns(16)
        d.put(cols, partition="p", device="keep")
        host, dev = usage(d)
        assert dev == 16 * 4 * 4 + sum(int(t.numel()) * 2 for t in cols["r"])  # x and r are device-resident
        assert 0 < host < 16 * 16  # only the uid strings went to host memory
        cols["x"].add_(1000)  # the writer's tensor is its own again: the warehouse holds a copy
        check(d.get("mapped", ["x", "r", "uid"], 16, partition="p", device="cpu", timeout=10), 16)
        assert shared_bytes(tier) == dev  # read through shared memory, copied once into the reader's
        check(d.get("bytes", ["x", "r", "uid"], 16, partition="p", timeout=10), 16)  # as host bytes
        assert shared_bytes(tier) == dev
        lease = d.acquire("low", ["x", "r", "uid"], 16, partition="p", timeout=10)  # inline on the controller's node
        check(dockd.Batch("p", lease.indexes, d.fetch(lease)), 16)


def fetches(cluster) -> int:
    """Fetch requests the daemon has answered."""
    return int(value(scrape(cluster.nodes[0]["metrics_port"]), "dockd_request_seconds_count", op="fetch"))


def test_a_device_get_from_the_controllers_node_is_one_round_trip(tier, monkeypatch, caplog):
    """Device-tier values held by the controller's own warehouse come shared by handle in the acquire
    reply, with the host-tier ones, to a same-node reader that asks for a device: no fetch. A reader
    that asks for host bytes fetches them; one that cannot map the memory fetches them as bytes."""
    with dockd.connect(tier.address) as d:
        d.put(sample_columns(16), partition="p", device="keep")
        before, shared = fetches(tier), shared_bytes(tier)
        check(d.get("mapped", ["x", "r", "uid"], 8, partition="p", device="cpu", timeout=10), 8)
        assert fetches(tier) == before  # the acquire carried everything
        assert shared_bytes(tier) > shared  # ... the device-tier runs as shared memory
        check(d.get("bytes", ["x", "r", "uid"], 16, partition="p", timeout=10), 16)  # host bytes: fetched
        assert fetches(tier) == before + 1

        from dockd.net import device_share

        def unmappable(desc):
            raise dockd.DockValueError("the device holding this buffer is not visible to this process")

        monkeypatch.setattr(device_share, "open_buffer", unmappable)
        with caplog.at_level(logging.WARNING, logger="dockd"):
            got = d.get("mapped", ["x", "r", "uid"], 8, partition="p", device="cpu", timeout=10)
        assert "cannot map the device memory of the controller's warehouse" in caplog.text
        assert got.indexes == list(range(8, 16))  # the rest, once: nothing lost or handed out twice
        want = sample_columns(16)
        assert torch.equal(got.stacked("x"), want["x"][8:]) and got["uid"] == want["uid"][8:]
        assert fetches(tier) > before + 1  # fetched, as host bytes


def test_a_get_whose_inline_device_copy_fails_gives_its_samples_back_at_once(tier, monkeypatch):
    """The reader runs out of device memory copying what the acquire shared: the get raises that
    error and its samples go back to the pool at once, not when its lease expires."""
    from dockd.net import device_share

    with dockd.connect(tier.address) as d:
        d.put(sample_columns(8), partition="p", device="keep")

        def out_of_memory(desc):
            raise torch.OutOfMemoryError("no room on the reader's device")

        with monkeypatch.context() as m, pytest.raises(torch.OutOfMemoryError):
            m.setattr(device_share, "open_buffer", out_of_memory)
            d.get("c", ["x", "r", "uid"], 8, partition="p", device="cpu", timeout=10)
        got = d.get("c", ["x", "r", "uid"], 8, partition="p", device="cpu", timeout=2)  # leases last minutes
        check(got, 8)


def test_a_full_or_absent_device_tier_spills_to_host_memory_and_says_so(tier, caplog):
    with dockd.connect(tier.address) as d, caplog.at_level(logging.WARNING, logger="dockd"):
        big = {"x": torch.ones(200, 512, dtype=torch.float32)}  # 400 KiB: more than the 256 KiB tier
        d.put(big, partition="p", device="keep")
        assert "stored in host memory" in caplog.text
        host, dev = usage(d)
        assert dev == 0 and host >= 200 * 512 * 4
        got = d.get("c", ["x"], 200, partition="p", device="cpu", timeout=10)
        assert torch.equal(got.stacked("x"), big["x"])
        assert metric(tier, "dockd_device_spilled_bytes_total") == 409600
    with dockd.start_local(1, capacity="16MiB") as plain, dockd.connect(plain.address) as d:  # no device tier at all
        d.put({"x": torch.ones(4, 8)}, partition="p", device="keep")
        assert usage(d) == (128, 0)
        assert torch.equal(d.get("c", ["x"], 4, partition="p", device="cpu", timeout=10).stacked("x"), torch.ones(4, 8))


def test_deletes_clears_and_retirement_give_device_memory_back(tier):
    with dockd.connect(tier.address) as d:
        d.put(sample_columns(8), partition="a", device="keep")
        d.put(sample_columns(8, 1), partition="a", device="keep")
        d.delete("a", list(range(8)))
        _, dev = usage(d)
        assert dev == usage_of_one_put()
        d.clear("a")
        assert usage(d) == (0, 0)
        d.create_partition("b", retire_when_consumed_by=["trainer"])
        d.put(sample_columns(8), partition="b", device="keep")
        check(d.get("trainer", ["x", "r", "uid"], 8, partition="b", device="cpu", timeout=10), 8)
        d.stats()  # (delivers the confirm)
        deadline = __import__("time").monotonic() + 10
        while usage(d)[1] and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.05)
        assert usage(d) == (0, 0)


def usage_of_one_put() -> int:
    cols = sample_columns(8)
    return cols["x"].numel() * 4 + sum(int(t.numel()) * 2 for t in cols["r"])


def test_checkpoints_and_tcp_writers_see_device_tier_data_as_bytes(tier, tmp_path, monkeypatch):
    with dockd.connect(tier.address) as d:
        d.put(sample_columns(6), partition="p", device="keep")
        d.save("p", tmp_path / "ckpt")
        d.clear("p")
        d.load(tmp_path / "ckpt", partition="p")
        check(d.get("c", ["x", "r", "uid"], 6, partition="p", device="cpu", timeout=10), 6)
    monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")  # a writer on another node: no memory to share by handle
    with dockd.connect(tier.address) as d:
        d.put(sample_columns(6, 2), partition="q", device="keep")
        assert usage(d)[1] == 0
        check(d.get("c", ["x", "r", "uid"], 6, partition="q", device="cpu", timeout=10), 6, 2)


def test_bad_device_puts_are_refused_and_the_daemon_keeps_serving(tier, raw):
    from dockd._proto import dockd_pb2 as pb

    with dockd.connect(tier.address) as d:
        with pytest.raises(dockd.DockValueError, match="takes 'keep'"):
            d.put({"x": torch.ones(2)}, partition="p", device="cuda")
        unix = d._router.warehouses[d.home].unix
    r = raw(tier.address, unix=unix)

    def put(buffer: pb.DeviceBuffer, nbytes: int = 16):
        req = pb.PutRequest(partition="p", new_count=1, group_size=1, device_buffers=[buffer])
        req.columns.add(name="x").runs.add(kind=pb.TENSOR, count=1, dtype="uint8", shape=[nbytes], nbytes=nbytes,
                                          device_buffer=1)
        return r.call(pb.Frame(id=7, put=req)).status

    # a name outside torch's shared memory (e.g. another program's file): refused before it is opened
    st = put(pb.DeviceBuffer(type="cpu", handle=b"/etc/passwd", manager=b"/tmp/x/manager.sock", storage_size=16,
                             nbytes=16))
    assert st.code != pb.OK and "must name torch shared memory" in st.message
    st = put(pb.DeviceBuffer(type="npu", handle=b"x", storage_size=16, nbytes=16))
    assert st.code != pb.OK
    if importlib.util.find_spec("torch_npu") is None:  # (on an Ascend node torch_npu itself refuses the handle)
        assert "an NPU device buffer reached a process that cannot map it" in st.message
    st = put(pb.DeviceBuffer(type="tpu", handle=b"x", storage_size=16, nbytes=16))
    assert st.code != pb.OK and "unknown device buffer type 'tpu'" in st.message
    t = torch.zeros(8, dtype=torch.uint8)
    from dockd.net import device_share

    desc, _ = device_share.export(t)
    st = put(desc, nbytes=64)  # runs past the shared buffer
    assert st.code != pb.OK and "end at byte 64 of a 8-byte device buffer" in st.message
    forged = pb.DeviceBuffer()
    forged.CopyFrom(desc)
    forged.storage_size = forged.nbytes = 1 << 20  # more than the shared memory holds: reading it would fault
    st = put(forged, nbytes=64)
    assert st.code != pb.OK and "not 1048576" in st.message
    with dockd.connect(tier.address) as d:  # still serving, nothing stored
        assert usage(d) == (0, 0)
        d.put(sample_columns(4), partition="p", device="keep")
        check(d.get("c", ["x", "r", "uid"], 4, partition="p", device="cpu", timeout=10), 4)


def test_a_warehouse_accepts_cpu_stand_in_buffers_only_when_told_to(monkeypatch):
    monkeypatch.delenv("DOCKD_CPU_DEVICE_TIER", raising=False)
    with dockd.start_local(1, capacity="16MiB", extra_args=["--device-capacity", "1MiB"]) as c:
        monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "1")  # this client only: the daemon started without it
        with dockd.connect(c.address) as d:
            with pytest.raises(dockd.DockValueError, match="only with DOCKD_CPU_DEVICE_TIER=1"):
                d.put({"x": torch.ones(4, 4)}, partition="p", device="keep")
            assert usage(d) == (0, 0)
            monkeypatch.delenv("DOCKD_CPU_DEVICE_TIER")
            d.put({"x": torch.ones(4, 4)}, partition="p", device="keep")  # CPU tensors: the host tier
            assert usage(d) == (64, 0)
