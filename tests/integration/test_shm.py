"""The same-host shared-memory transport: selection, zero-copy gets, lifetime, no leaks."""

from __future__ import annotations

import os
import time

import pytest
import torch

import dockd
from dockd.local import spawn_node
from dockd.net import reply_maps, same_host
from tests.conftest import wait_until

pytestmark = pytest.mark.skipif(not same_host.available(), reason="needs Linux memfd and SCM_RIGHTS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def dockd_shm_names() -> set[str]:
    """Named shared memory of dockd's; memfd segments have no names, so this stays empty."""
    return {n for n in os.listdir("/dev/shm") if "dockd" in n} if os.path.isdir("/dev/shm") else set()


def test_same_host_clients_pick_shared_memory_and_tcp_can_be_forced(cluster, monkeypatch, caplog):
    caplog.set_level("INFO", logger="dockd.client.dock")
    with dockd.connect(cluster.address) as d:
        assert d._router.ctrl.transport == "shm"
        assert d._router.pool(0).transport == "shm" and d._router.pool(1).transport == "shm"
    assert "transport=shm" in caplog.text  # the choice is logged
    monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    with dockd.connect(cluster.address) as d:
        assert d._router.ctrl.transport == "tcp" and d._router.pool(1).transport == "tcp"


def test_daemon_without_shm_serves_tcp():
    proc, ready = spawn_node(["--controller", "--port", "0", "--no-shm"])
    try:
        with dockd.connect(f"127.0.0.1:{ready['port']}") as d:
            assert d._router.ctrl.transport == "tcp" and d._router.pool(0).transport == "tcp"
            d.put({"x": torch.ones(4, 1 << 17)}, partition="p")
            assert torch.equal(torch.stack(d.get("c", ["x"], 4, partition="p", timeout=5)["x"]), torch.ones(4, 1 << 17))
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_values_round_trip_on_both_paths(cluster, partition, monkeypatch, transport):
    if transport == "tcp":
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    data = torch.randn(8, 1 << 16).to(torch.bfloat16)  # 128 KiB per sample: passed by descriptor on shm
    with dockd.connect(cluster.address, warehouse=1) as w, dockd.connect(cluster.address, warehouse=0) as r:
        w.put({"x": data, "small": list(range(8))}, partition=partition)
        b = r.get("c", ["x", "small"], 8, partition=partition, timeout=10)
        assert torch.equal(torch.stack(b["x"]).view(torch.int16), data.view(torch.int16))
        assert b["small"] == list(range(8))


def test_returned_tensors_are_private_and_outlive_a_clear(cluster, partition):
    data = torch.arange(4 * (1 << 16), dtype=torch.float32).reshape(4, -1)
    with dockd.connect(cluster.address, warehouse=1) as d:
        d.put({"x": data}, partition=partition)
        first = d.get("a", ["x"], 4, partition=partition, timeout=10)["x"]
        first[0].fill_(-1)  # writing to a returned tensor copies that page only
        second = d.get("b", ["x"], 4, partition=partition, timeout=10)["x"]
        assert torch.equal(torch.stack(second), data)
        d.clear(partition)
        # the memory the reader maps stays valid after the warehouse freed it
        assert torch.equal(torch.stack(second), data)
        assert (first[0] == -1).all() and torch.equal(torch.stack(first[1:]), data[1:])


def test_no_descriptor_or_segment_leaks_even_when_a_client_is_killed(partition, client):
    """Segments are recycled, not leaked: a reader killed while it maps some unpins them by dying
    (the warehouse watches its process), and the next round of puts reuses them. (Names left in /dev/shm
    by something else on the machine before the test, a killed run's data dir, are not this test's.)"""
    before = dockd_shm_names()
    code = """
import os, sys, torch, dockd
d = dockd.connect(sys.argv[1], warehouse=1)
d.put({"x": torch.randn(2, 1 << 18)}, partition=sys.argv[2])
b = d.get("killed", ["x"], 12, partition=sys.argv[2], timeout=10)
os.kill(os.getpid(), 9)
"""
    with dockd.start_local(2) as c:
        pids = [p.pid for p in c.procs]
        with dockd.connect(c.address, warehouse=1) as d:
            d.put({"warm": torch.zeros(1)}, partition="warm")
            base = open_fds(pids[1])
            after = []
            for round_ in range(3):
                part = f"{partition}-{round_}"
                for _k in range(5):
                    d.put({"x": torch.randn(4, 1 << 17)}, partition=part)
                assert open_fds(pids[1]) >= base + 5  # each shared-memory put body is one segment
                out = client(code, c.address, part, check=False)
                assert out.returncode == -9
                assert d.clear(part) == 22
                deadline = time.monotonic() + 10  # the killed reader's pins go when its process is reaped
                while len(after) == round_ and time.monotonic() < deadline:
                    if round_ == 0 or open_fds(pids[1]) <= after[0]:
                        after.append(open_fds(pids[1]))
                    else:
                        time.sleep(0.05)
            # 6 segments (5 puts + the killed reader's) kept warm for reuse, and a pidfd watching this
            # process (it maps segments too); then no growth, round after round
            assert len(after) == 3 and after[2] <= after[0] <= base + 7, (base, after)
    assert dockd_shm_names() - before == set()


def test_odd_sized_large_bodies_on_both_paths(cluster, partition, monkeypatch):
    """Bodies that are not a whole number of huge pages (their segments are padded)."""
    data = torch.randint(0, 255, (3, 1_234_567), dtype=torch.uint8)
    with dockd.connect(cluster.address, warehouse=1) as d:
        d.put({"x": data}, partition=partition)
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(cluster.address, warehouse=1) as t:
            t.put({"x": data}, partition=partition)
            b = t.get("c", ["x"], 6, partition=partition, timeout=10)
        assert all(torch.equal(v, data[i % 3]) for i, v in enumerate(b["x"]))
        assert torch.equal(torch.stack(d.read(partition, [0, 1, 2], ["x"])["x"]), data)


def test_a_staged_put_copied_in_off_the_event_loop_arrives_whole(cluster, partition):
    """A same-host put of COPY_OFF_LOOP bytes or more is copied into the warehouse's storage by a worker
    thread, so the daemon keeps answering meanwhile: its bytes arrive whole, into a fresh segment and
    then a recycled one, and a small put to the same warehouse is served next to it."""
    from dockd.warehouse.put import COPY_OFF_LOOP

    data = torch.randint(0, 255, (1, COPY_OFF_LOOP + 12_345), dtype=torch.uint8)
    with dockd.connect(cluster.address, warehouse=1) as d:
        for rep in range(2):
            data[0, :8] = rep
            assert d.put({"x": data}, partition=partition) == [0]
            assert d.put({"x": torch.full((1, 4), float(rep))}, partition=partition + "-small") == [rep]
            b = d.get("c", ["x"], 1, partition=partition, timeout=30)
            assert torch.equal(b["x"][0], data[0])
            del b
            d.clear(partition)


def test_a_warehouse_at_its_descriptor_limit_copies_puts_instead_of_dropping_clients():
    """Every same-host put body is a segment holding a descriptor. With `ulimit -n 256` the
    daemon stops near its budget (256 - 160 reserved for connections, descriptors in flight and
    libraries) and copies further puts into private
    memory; past the limit the kernel would drop the next descriptor and the client's connection."""
    proc, ready = spawn_node(["--controller", "--port", "0"], prefix=["prlimit", "--nofile=256:256"])
    try:
        puts, per_put = 300, 2  # 300 bodies of 2 x 160 KiB, each over the shared-memory threshold
        def batch(k: int) -> torch.Tensor:
            return torch.arange(per_put * (160 << 10), dtype=torch.int32).view(per_put, -1).add_(k).to(torch.uint8)

        with dockd.connect(f"127.0.0.1:{ready['port']}") as d:
            assert d._router.pool(0).transport == "shm"
            for k in range(puts):
                d.put({"x": batch(k)}, partition="p")
            held = open_fds(proc.pid)
            assert 96 <= held < 256, held  # segments up to the budget, then copies
            got = d.get("c", ["x"], puts * per_put, partition="p", timeout=30)
            for k in range(puts):
                assert torch.equal(torch.stack(got["x"][k * per_put : (k + 1) * per_put]), batch(k)), k
            assert d.clear("p") == puts * per_put
            assert open_fds(proc.pid) < 60  # every segment's descriptor is closed again
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


def test_zero_copy_results_hold_no_descriptors(cluster, partition, client):
    """A trainer may keep thousands of zero-copy results alive; their mappings must not each
    pin a descriptor, or a client under the common `ulimit -n 1024` runs out and loses its
    connection. Here: 300 live mappings under a limit of 128."""
    code = """
import os, resource, sys, torch, dockd
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
d = dockd.connect(sys.argv[1], warehouse=0)
n = 300
for k in range(n):  # one body (one segment) per put, 256 KiB values: passed by descriptor
    d.put({"x": torch.full((2, 1 << 18), k % 251, dtype=torch.uint8)}, partition=sys.argv[2])
held = [d.get("c", ["x"], 2, partition=sys.argv[2], timeout=10)["x"] for _ in range(n)]
for k, pair in enumerate(held):
    assert all(bool((t == k % 251).all()) for t in pair), k
print(len(os.listdir("/proc/self/fd")))
"""
    out = client(code, cluster.address, partition)
    assert int(out.stdout.split()[-1]) < 64


def test_a_client_out_of_descriptors_gets_a_clear_error_and_loses_no_samples(cluster, partition, client):
    """When the kernel drops the descriptors of a reply (the client is at its open-file
    limit), the call fails saying so; the samples go back to the pool and a later get,
    with room again, returns them."""
    code = """
import os, resource, sys, torch, dockd
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
d = dockd.connect(sys.argv[1], warehouse=0)
for k in range(3):  # three segments: the reply to a get of all six passes three descriptors
    d.put({"x": torch.full((2, 1 << 17), k, dtype=torch.uint8)}, partition=sys.argv[2])
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(filler.pop())  # room for one descriptor, not three
try:
    d.get("c", ["x"], 6, partition=sys.argv[2], timeout=10)
except dockd.DockConnectionError as e:
    print("ERROR:", e)
for fd in filler:
    os.close(fd)
b = d.get("c", ["x"], 6, partition=sys.argv[2], timeout=30)
assert [int(t[0]) for t in b["x"]] == [0, 0, 1, 1, 2, 2], b["x"]
print("RECOVERED", b.indexes)
"""
    out = client(code, cluster.address, partition)
    assert "ERROR:" in out.stdout and "open-file limit (64)" in out.stdout and "ulimit -n" in out.stdout, out.stdout
    assert "RECOVERED [0, 1, 2, 3, 4, 5]" in out.stdout, out.stdout


@pytest.mark.parametrize("wid", [0, 1], ids=["controller-s-warehouse", "another-warehouse"])
def test_a_put_is_answered_before_the_copy_out_of_its_lent_staging_buffer_and_reads_back_whole(cluster, partition,
                                                                                               wid):
    """A same-host writer lends its staging buffer: the warehouse answers the put, then copies the bulk
    of the payload out before it reads another request, and the writer refills the buffer only after a
    later put is answered. So one writer alternates two buffers, and each put, read at once by another
    client (values by descriptor and inline), is whole. On the controller's own warehouse (commit in
    the same turn of its loop) and on another one (the commit goes over its link)."""
    with dockd.connect(cluster.address, warehouse=wid) as w, dockd.connect(cluster.address) as r:
        for i in range(1, 25):
            x = torch.full((2, 256 * 1024), float(i))  # 2 MiB: staged, and read by descriptor
            y = torch.full((2, 16), float(-i))  # read inline
            tags = [f"put-{i}-{k}" for k in range(2)]  # msgpack: checked before the answer
            w.put({"x": x, "y": y, "tag": tags}, partition=partition)
            b = r.get("c", ["x", "y", "tag"], 2, partition=partition, timeout=10)
            assert b["tag"] == tags
            assert all(torch.equal(v, x[0]) for v in b["x"]) and all(torch.equal(v, y[0]) for v in b["y"])
            del b
        staging = w._router.pool(wid).via.staging
        assert staging._lends == 24, "the warehouse copied before it answered: no put lent its buffer"
        assert len(staging._free) + len(staging._lent) == 2


def test_a_warehouse_with_a_data_dir_copies_a_staged_put_before_it_answers(tmp_path, partition):
    """With --data-dir a put is written to its file before it is answered, so no staging buffer is lent."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", DOCKD_DAEMON_SECRET="ef" * 32)
    common = ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--log-level", "WARNING"]
    nodes = []
    try:
        node, ready = spawn_node([*common, "--controller", "--no-warehouse"], env=env)
        nodes.append(node)
        address = f"127.0.0.1:{ready['port']}"
        nodes.append(spawn_node([*common, "--join", address, "--data-dir", str(tmp_path / "data")], env=env)[0])
        with dockd.connect(address) as d:
            x = torch.arange(2 * 256 * 1024, dtype=torch.float32).reshape(2, -1)
            for _ in range(3):
                d.put({"x": x}, partition=partition)
            b = d.get("c", ["x"], 6, partition=partition, timeout=10)
            assert all(torch.equal(v, x[k % 2]) for k, v in enumerate(b["x"]))
            (pool,) = d._router.pools.values()
            assert pool.via.staging._lends == 0
    finally:
        for node in reversed(nodes):
            node.terminate()
            node.wait(10)
            node.stdout.close()


def _store_mappings() -> int:
    """Mappings of warehouse segments in this process (zero-copy results)."""
    with open("/proc/self/maps") as f:
        return sum("memfd:dockd-store" in line for line in f)


def test_a_get_of_a_few_hundred_kib_comes_as_bytes_and_a_bigger_one_mapped(cluster, partition):
    """Mapping a segment costs a reader more than copying a few hundred KiB (a get of 64 values of 4 KiB
    went from ~98k to ~107k samples/s copied); above same_host.SHM_COPY_REPLY bytes the values come by descriptor."""
    with dockd.connect(cluster.address, warehouse=0) as d:
        small = torch.randint(0, 255, (64, 4096), dtype=torch.uint8)  # 256 KiB: as bytes
        big = torch.randint(0, 255, (64, 16384), dtype=torch.uint8)  # 1 MiB: by descriptor
        d.put({"x": small}, partition=partition)
        d.put({"x": big}, partition=partition + "-big")
        before = _store_mappings()
        got = d.get("c", ["x"], 64, partition=partition, timeout=10)["x"]
        assert torch.equal(torch.stack(got), small)
        assert _store_mappings() == before
        got_big = d.get("c", ["x"], 64, partition=partition + "-big", timeout=10)["x"]
        assert torch.equal(torch.stack(got_big), big)
        assert _store_mappings() == before + 1
        del got_big
        d.ping()  # (the next call to the daemon unpins it, and keeps the mapping: none of its pages was written)
        assert _store_mappings() == before + 1 and reply_maps.kept_bytes() > 0
        again = d.get("c2", ["x"], 64, partition=partition + "-big", timeout=10)["x"]  # (its segment, passed again)
        assert torch.equal(torch.stack(again), big) and _store_mappings() == before + 1
        d.clear(partition)
        d.clear(partition + "-big")


def test_with_dockd_keep_mappings_0_the_next_call_unmaps_a_reply_whose_values_are_gone(cluster, partition, monkeypatch):
    monkeypatch.setenv("DOCKD_KEEP_MAPPINGS", "0")
    with dockd.connect(cluster.address, warehouse=0) as d:
        big = torch.randint(0, 255, (64, 16384), dtype=torch.uint8)  # 1 MiB: by descriptor
        d.put({"x": big}, partition=partition)
        before = _store_mappings()
        got = d.get("c", ["x"], 64, partition=partition, timeout=10)["x"]
        assert torch.equal(torch.stack(got), big) and _store_mappings() == before + 1
        del got
        d.ping()  # (the next call to the daemon unmaps it)
        assert _store_mappings() == before
        d.clear(partition)


@pytest.mark.parametrize("keep", ["0", str(64 << 20)])
def test_a_mapped_reply_whose_values_are_gone_is_unmapped_when_no_call_comes(cluster, partition, monkeypatch, keep):
    """Dropping a reply's last value leaves its unmapping to the next call to that daemon (right after it is
    sent, the tests above) or, when none comes, to the flusher; a mapping kept (DOCKD_KEEP_MAPPINGS) goes once
    unused for reply_maps.KEEP_IDLE_S: the mapping is not kept for ever."""
    monkeypatch.setenv("DOCKD_KEEP_MAPPINGS", keep)
    with dockd.connect(cluster.address, warehouse=0) as d:
        big = torch.randint(0, 255, (64, 16384), dtype=torch.uint8)  # 1 MiB: by descriptor
        d.put({"x": big}, partition=partition)
        before = _store_mappings()
        got = d.get("c", ["x"], 64, partition=partition, timeout=10)["x"]
        assert torch.equal(torch.stack(got), big) and _store_mappings() == before + 1
        del got  # (no call follows)
        wait_until(lambda: _store_mappings() == before, timeout=10, what="the flusher unmapping a reply whose values are gone")
        d.clear(partition)
