"""Cross-node device reads over device links, through real daemons.

A reader on another node (here: a client that reaches the warehouse over TCP,
DOCKD_TRANSPORT=tcp) that asks for device-tier data on its accelerator opens a
two-rank link to the warehouse and receives each device buffer's used span
over it, with only metadata on dockd's wire. On machines without an
accelerator DOCKD_CPU_DEVICE_TIER=1 runs the same protocol over torch's gloo
process group; tests/gpu has the NCCL run.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import dockd
from dockd._proto import dockd_pb2 as pb
from dockd.net import device_link
from tests.conftest import wait_until
from tests.integration.test_device_tier import check, metric, sample_columns, usage

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tier(monkeypatch):
    monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "1")
    monkeypatch.setenv("DOCKD_DEVICE_LINK_TIMEOUT", "5")
    with dockd.start_local(1, capacity="64MiB", extra_args=["--device-capacity", "1MiB", "--metrics-port", "0"]) as c:
        yield c


def remote_reader(cluster, monkeypatch) -> dockd.Dock:
    """A client that reaches the warehouse as one on another node does: over TCP, no handles to share."""
    monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    d = dockd.connect(cluster.address)
    monkeypatch.delenv("DOCKD_TRANSPORT")
    return d


def links(cluster) -> int:
    return int(metric(cluster, "dockd_device_links"))


def linked_bytes(cluster) -> int:
    return int(metric(cluster, "dockd_device_linked_bytes_total"))


def test_a_remote_reader_gets_device_tier_data_over_one_kept_link(tier, monkeypatch, caplog):
    with dockd.connect(tier.address) as w:
        w.put(sample_columns(16), partition="p", device="keep")
        w.put(sample_columns(16, 1), partition="q", device="keep")
        _, dev = usage(w)
    with remote_reader(tier, monkeypatch) as r, caplog.at_level(logging.WARNING, logger="dockd"):
        got = r.get("c", ["x", "r", "uid"], 16, partition="p", device="cpu", timeout=10)
        check(got, 16)
        assert links(tier) == 1
        check(r.get("c", ["x", "r", "uid"], 16, partition="q", device="cpu", timeout=10), 16, 1)
        assert links(tier) == 1  # the second read used the same link
        assert linked_bytes(tier) == dev  # every device-tier byte went over the link, none as host bytes
        assert int(metric(tier, "dockd_device_shared_bytes_total")) == 0
        # a read without a device asks for no link: host bytes, as before
        r.put(sample_columns(4, 2), partition="h")
        check(r.get("c", ["x", "r", "uid"], 4, partition="h", timeout=10), 4, 2)
        assert linked_bytes(tier) == dev
        assert "device link" not in caplog.text
    wait_until(lambda: links(tier) == 0, 10, "the warehouse to drop the link of a closed reader")


def test_a_link_the_warehouse_lost_is_made_again_and_no_read_fails(tier, monkeypatch):
    with dockd.connect(tier.address) as w:
        for k in range(3):
            w.put(sample_columns(8, k), partition=f"p{k}", device="keep")
    with remote_reader(tier, monkeypatch) as r:
        check(r.get("c", ["x", "r", "uid"], 8, partition="p0", device="cpu", timeout=10), 8, 0)
        before = linked_bytes(tier)
        r._router.forget(r.home)  # the connections that opened the link close: the warehouse drops it
        wait_until(lambda: links(tier) == 0, 10, "the link to be dropped")
        # the next read names a link the warehouse no longer has: its device data comes as bytes
        check(r.get("c", ["x", "r", "uid"], 8, partition="p1", device="cpu", timeout=10), 8, 1)
        assert linked_bytes(tier) == before
        # and the one after opens a new link
        check(r.get("c", ["x", "r", "uid"], 8, partition="p2", device="cpu", timeout=10), 8, 2)
        assert links(tier) == 1 and linked_bytes(tier) > before


def test_concurrent_remote_reads_share_the_link_in_order(tier, monkeypatch):
    n = 8
    with dockd.connect(tier.address) as w:
        for k in range(n):
            w.put(sample_columns(8, k), partition=f"p{k}", device="keep")
    errors = []
    with remote_reader(tier, monkeypatch) as r:
        def read(k: int) -> None:
            try:
                check(r.get("c", ["x", "r", "uid"], 8, partition=f"p{k}", device="cpu", timeout=20), 8, k)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=read, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert links(tier) == 1


def test_bad_link_requests_get_clear_errors_and_the_warehouse_keeps_serving(tier, raw, monkeypatch):
    with dockd.connect(tier.address) as w:
        w.put(sample_columns(4), partition="p", device="keep")
    c = raw(tier.address)
    cols = [pb.FetchColumn(name="x", indexes=[0, 1])]

    def fetch(link: pb.DeviceLink) -> pb.Frame:
        return c.call(pb.Frame(id=9, fetch=pb.FetchRequest(partition="p", columns=cols, link=link)))

    st = fetch(pb.DeviceLink(id=b"short", backend="gloo")).status
    assert st.code == pb.INVALID_ARGUMENT and "device link id is 16 bytes" in st.message
    st = fetch(pb.DeviceLink(id=bytes(16), backend="gloo", rendezvous=bytes(5000))).status
    assert st.code == pb.INVALID_ARGUMENT and "rendezvous of 5000 bytes is too long" in st.message
    # a link it does not know, without a rendezvous: the data comes as bytes, marked so
    reply = fetch(pb.DeviceLink(id=bytes(16), backend="gloo"))
    assert reply.status.code == pb.OK and reply.fetch_reply.link_unknown
    assert not reply.fetch_reply.device_buffers and reply.fetch_reply.columns[0].runs[0].device_buffer == 0
    # a backend for another kind of device: refused with the reason, data as bytes
    reply = fetch(pb.DeviceLink(id=bytes(16), backend="nccl", rendezvous=bytes(128)))
    assert reply.status.code == pb.OK and "not on nccl devices" in reply.fetch_reply.link_refused
    # a rendezvous nobody answers: the warehouse opens the link, its join fails in time, the link goes
    reply = fetch(pb.DeviceLink(id=bytes(range(16)), backend="gloo", rendezvous=b"127.0.0.1:1"))
    assert reply.status.code == pb.OK and reply.fetch_reply.link_opened
    wait_until(lambda: links(tier) == 0, 30, "the failed link to be dropped")
    with remote_reader(tier, monkeypatch) as r:
        check(r.get("c", ["x", "r", "uid"], 4, partition="p", device="cpu", timeout=10), 4)


def test_link_pair_moves_tensors_and_a_missing_peer_times_out(monkeypatch):
    """The two ends of a gloo link in one process (threads): join, transfers in order, and a join whose
    other end never comes fails within DOCKD_DEVICE_LINK_TIMEOUT instead of hanging."""
    monkeypatch.setenv("DOCKD_DEVICE_LINK_TIMEOUT", "3")
    cpu = torch.device("cpu")
    reader = device_link.Link.offer("gloo", cpu, "127.0.0.1")
    holder = device_link.Link("gloo", cpu)
    src = [torch.arange(10, dtype=torch.uint8), torch.arange(300, dtype=torch.uint8) % 7]
    dst = [torch.empty(10, dtype=torch.uint8), torch.empty(300, dtype=torch.uint8)]
    t = threading.Thread(target=lambda: (holder.join(reader.rendezvous, device_link.HOLDER), holder.send(src)))
    t.start()
    reader.join(reader.rendezvous, device_link.READER)
    reader.recv(dst)
    t.join(10)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    reader.close()
    holder.close()
    lonely = device_link.Link.offer("gloo", cpu, "127.0.0.1")
    start = time.monotonic()
    with pytest.raises(dockd.DockError):
        lonely.join(lonely.rendezvous, device_link.READER)
    assert time.monotonic() - start < 30
    with pytest.raises(dockd.DockValueError, match="cannot move tensors on cpu"):
        device_link.Link("nccl", cpu)
