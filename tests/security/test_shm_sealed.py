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
from dockd import shm
from dockd._proto import dockd_pb2 as pb
from dockd.client.router import call_on

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not shm.available(), reason="Linux shared memory only")]


def _refused(op) -> None:
    with pytest.raises(OSError) as e:
        op()
    assert e.value.errno in (errno.EPERM, errno.EACCES, errno.EBUSY), e.value


def test_readers_and_writers_cannot_change_stored_segments(cluster, partition):
    data = torch.arange(1 << 18, dtype=torch.int32).view(4, 1 << 16)  # 256 KiB per sample: passed by descriptor
    with dockd.connect(cluster.address, warehouse=0) as d:
        assert d._router.pool(0).unix, "a same-host client uses shared memory"
        d.put({"x": data}, partition=partition)
        # a reader asks the warehouse itself, keeping the descriptors the reply carries
        req = pb.FetchRequest(partition=partition)
        req.columns.add(name="x", indexes=[0, 1, 2, 3])
        reply, _, fds = call_on(d._router.pool(0), pb.Frame(fetch=req))
        assert fds, "large values come by descriptor"
        try:
            for fd in fds:
                assert shm.seals(fd) & (shm.F_SEAL_WRITE | shm.F_SEAL_FUTURE_WRITE)
                _refused(lambda: os.pwrite(fd, b"evil", 0))
                _refused(lambda: os.ftruncate(fd, 0))
                _refused(lambda: mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE | mmap.PROT_READ))
                private = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_WRITE | mmap.PROT_READ)
                private[:4] = b"mine"  # copy-on-write: the reader's own page only
                private.close()
        finally:
            for fd in fds:
                os.close(fd)
        got = d.get("c", ["x"], 4, partition=partition, timeout=10)
        assert torch.equal(torch.stack(got["x"]), data)


def test_a_writer_cannot_change_a_put_after_it_and_unsealed_puts_are_refused(cluster, partition):
    with dockd.connect(cluster.address, warehouse=0) as d:
        pool = d._router.pool(0)
        payload = bytes(range(256)) * 2048  # 512 KiB

        def put(sealed: bool):
            fd = os.memfd_create("test-put", shm.MFD_FLAGS)
            os.ftruncate(fd, len(payload))
            os.pwrite(fd, payload, 0)
            if sealed:
                shm.seal(fd, shm.SEALED)
            req = pb.PutRequest(partition=partition, new_count=1, group_size=1, timeout=5, shm_size=len(payload))
            req.columns.add(name="x").runs.add(kind=pb.TENSOR, count=1, dtype="uint8", shape=[len(payload)], offset=0,
                                                 nbytes=len(payload))
            return fd, lambda: call_on(pool, pb.Frame(put=req), fds=[fd])

        fd, send = put(sealed=False)
        try:
            with pytest.raises(dockd.DockProtocolError, match="must be sealed"):
                send()
        finally:
            os.close(fd)
        fd, send = put(sealed=True)
        try:
            reply, _, _ = send()
            _refused(lambda: os.pwrite(fd, b"evil", 0))  # the writer kept its descriptor: still nothing
            _refused(lambda: os.ftruncate(fd, 0))
        finally:
            os.close(fd)
        idx = list(reply.put_reply.indexes)
        got = d.read(partition, idx, ["x"])["x"][0]
        assert bytes(got.numpy()) == payload
