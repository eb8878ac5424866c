"""Cross-node device reads: a reader that reaches the warehouse over TCP (as one on another node
does) gets device-tier data on its device over a device link made with dockd's bindings (NCCL on
NVIDIA GPUs, HCCL on Ascend NPUs).

The reader uses a second device when there is one; with one GPU both ends of an NCCL link share
it, the warehouse and the reader each claiming a host of their own (`own_host_env`: NCCL refuses
two ranks on one GPU of one host). HCCL needs two NPUs.
"""

from __future__ import annotations

import pytest
import torch

import dockd
from dockd.device import own_host_env

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def start_on_own_hosts(monkeypatch, **kw) -> dockd.LocalCluster:
    """start_local for links whose two ends may share a GPU: the daemon claims a host of its own
    for NCCL and this process, the reader, another (`own_host_env`), before either's first NCCL
    call. NCCL refuses two ranks of one communicator on one GPU of one host."""
    for k, v in own_host_env("warehouse").items():
        monkeypatch.setenv(k, v)
    cluster = dockd.start_local(1, **kw)  # each daemon copies the environment as it starts
    monkeypatch.setenv("NCCL_HOSTID", own_host_env("reader")["NCCL_HOSTID"])
    return cluster


def test_remote_device_get_over_a_device_link(accel, monkeypatch):
    kind = accel
    ndev = getattr(torch, kind).device_count()  # torch.cuda, or torch.npu
    if ndev < 2 and kind == "npu":
        pytest.skip("an HCCL link needs two NPUs")
    x = torch.randn(256, 1024, device=f"{kind}:0").bfloat16()
    rag = [torch.arange(n, dtype=torch.int64, device=f"{kind}:0") for n in (1, 5, 1000, 3)] * 64  # one per row
    monkeypatch.setenv("DOCKD_DEVICE_LINK_TIMEOUT", "120")
    dev = torch.device(kind, min(1, ndev - 1))
    args = ["--device-capacity", "64MiB"]
    one_gpu = kind == "cuda" and ndev < 2
    cluster = start_on_own_hosts(monkeypatch, extra_args=args) if one_gpu else dockd.start_local(1, extra_args=args)
    with cluster as c, dockd.connect(c.address) as w:
        w.put({"x": x, "r": rag}, partition="p", device="keep")
        w.put({"x": x + 1, "r": rag}, partition="q", device="keep")
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(c.address) as r:
            for part, want in (("p", x), ("q", x + 1)):  # the first opens the link, the second reuses it
                b = r.get("gpu", ["x", "r"], 256 if part == "p" else 64, partition=part, device=dev, timeout=120)
                got = b.stacked("x")
                assert got.device == dev
                assert torch.equal(got.cpu(), want[: len(got)].cpu())
                assert all(g.device == dev and torch.equal(g.cpu(), e.cpu())
                           for g, e in zip(b["r"], rag))
            assert len(r._links._links) == 1 and not r._links._off, r._links._off


def test_device_data_on_several_devices_of_a_node_all_goes_over_one_link(accel, monkeypatch):
    """Writers on two devices of the warehouse's node; one remote reader's get spans both: the
    warehouse copies what is not on the link's device onto it and sends everything over the link."""
    from tests.integration.test_device_tier import metric

    kind = accel
    if getattr(torch, kind).device_count() < 2:
        pytest.skip(f"needs two {kind} devices")
    monkeypatch.setenv("DOCKD_DEVICE_LINK_TIMEOUT", "120")
    parts = [torch.randn(32, 4096, device=f"{kind}:{i}") + i for i in (0, 1)]
    args = ["--device-capacity", "64MiB", "--metrics-port", "0"]
    # the warehouse's end may be on the reader's GPU
    cluster = start_on_own_hosts(monkeypatch, extra_args=args) if kind == "cuda" else dockd.start_local(1, extra_args=args)
    with cluster as c, dockd.connect(c.address) as w:
        for x in parts:
            w.put({"x": x}, partition="p", device="keep")
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(c.address) as r:
            got = r.get("gpu", ["x"], 64, partition="p", device=f"{kind}:0", timeout=120).stacked("x")
        assert got.device == torch.device(kind, 0)
        assert torch.equal(got.cpu(), torch.cat([x.cpu() for x in parts]))
        assert int(metric(c, "dockd_device_linked_bytes_total")) == 2 * 32 * 4096 * 4  # none as host bytes
