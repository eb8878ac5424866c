"""Stored shared memory cannot be changed by anyone (finding 3): not by a reader through the
descriptor a get passes, not by a writer through the descriptor it put, and a put whose
segment is not sealed is refused."""

from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch

import dockd
from dockd._proto import dockd_pb2 as pb
from dockd.net import memfd, same_host

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not same_host.available(), reason="Linux shared memory only")]


def _refused(op) -> None:
    with pytest.raises(OSError) as e:
        op()
    assert e.value.errno in (errno.EPERM, errno.EACCES, errno.EBUSY), e.value


def test_readers_and_writers_cannot_change_stored_segments(cluster, partition):
    data = torch.arange(1 << 18, dtype=torch.int32).view(4, 1 << 16)  # 256 KiB per sample: passed by descriptor
    with dockd.connect(cluster.address, warehouse=0) as d:
        assert d._router.pool(0).transport == "shm", "a same-host client uses shared memory"
        d.put({"x": data}, partition=partition)
        # a reader asks the warehouse itself, keeping the descriptors the reply carries
        req = pb.FetchRequest(partition=partition)
        req.columns.add(name="x", indexes=[0, 1, 2, 3])
        reply, _, fds = d._router.pool(0).call(pb.Frame(fetch=req))
        assert fds, "large values come by descriptor"
        try:
            for fd in fds:
                assert memfd.seals(fd) & (memfd.F_SEAL_WRITE | memfd.F_SEAL_FUTURE_WRITE)
                _refused(lambda fd=fd: os.pwrite(fd, b"evil", 0))
                _refused(lambda fd=fd: os.ftruncate(fd, 0))
                _refused(lambda fd=fd: mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE | mmap.PROT_READ))
                private = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_WRITE | mmap.PROT_READ)
                private[:4] = b"mine"  # copy-on-write: the reader's own page only
                private.close()
        finally:
            for fd in fds:
                os.close(fd)
        got = d.get("c", ["x"], 4, partition=partition, timeout=10)
        assert torch.equal(torch.stack(got["x"]), data)


def test_a_writer_cannot_change_a_put_after_it(cluster, partition):
    """The warehouse copies a same-host put out of the writer's staging buffer before it answers."""
    with dockd.connect(cluster.address, warehouse=0) as d:
        data = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB: staged
        d.put({"x": [data]}, partition=partition)
        staging = d._router.pool(0).via.staging
        for buf in staging._free:  # scribble over every staging buffer the put could have used
            os.pwrite(buf.fd, b"\xff" * 4096, 0)
            _refused(lambda buf=buf: os.ftruncate(buf.fd, 0))  # and it cannot vanish under the warehouse
        got = d.get("c", ["x"], 1, partition=partition, timeout=10)["x"][0]
        assert torch.equal(got, data)


def test_a_segment_a_reader_maps_is_never_refilled(cluster, partition):
    """Cleared data's segments are reused for new puts, but only once no reader maps them."""
    with dockd.connect(cluster.address, warehouse=0) as d:
        first = torch.full((1 << 18,), 7, dtype=torch.int32)
        d.put({"x": [first]}, partition=partition)
        held = d.get("c", ["x"], 1, partition=partition, timeout=10)["x"][0]  # zero-copy, pinned
        d.clear(partition)
        for k in range(6):  # puts of the same size: they would take a freed segment first
            d.put({"x": [torch.full((1 << 18,), k, dtype=torch.int32)]}, partition=f"{partition}-{k}")
        assert torch.equal(held, first)
        for k in range(6):
            got = d.get("c", ["x"], 1, partition=f"{partition}-{k}", timeout=10)["x"][0]
            assert int(got[0]) == k and int(got[-1]) == k
            d.clear(f"{partition}-{k}")
