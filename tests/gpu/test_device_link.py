"""Cross-node device reads: a reader that reaches the warehouse over TCP (as one on another node
does) gets device-tier data on its device over a device link made with dockd's bindings (NCCL on
NVIDIA GPUs, HCCL on Ascend NPUs).

The reader uses a second device when there is one; with one GPU both ends of an NCCL link share
it (NCCL_MULTI_RANK_GPU_ENABLE=1, which NCCL 2.2x+ asks for before it puts two ranks on one GPU).
HCCL needs two NPUs.
"""

from __future__ import annotations

import pytest
import torch

import dockd

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_remote_device_get_over_a_device_link(accel, monkeypatch):
    kind = accel
    ndev = getattr(torch, kind).device_count()  # torch.cuda, or torch.npu
    if ndev < 2:
        if kind == "npu":
            pytest.skip("an HCCL link needs two NPUs")
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # the warehouse inherits it
    x = torch.randn(256, 1024, device=f"{kind}:0").bfloat16()
    rag = [torch.arange(n, dtype=torch.int64, device=f"{kind}:0") for n in (1, 5, 1000, 3)] * 16
    monkeypatch.setenv("DOCKD_DEVICE_LINK_TIMEOUT", "120")
    dev = torch.device(kind, min(1, ndev - 1))
    with dockd.start_local(1, extra_args=["--device-capacity", "64MiB"]) as c, dockd.connect(c.address) as w:
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
    if kind == "cuda":  # the warehouse's end may be on the reader's GPU
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    parts = [torch.randn(32, 4096, device=f"{kind}:{i}") + i for i in (0, 1)]
    args = ["--device-capacity", "64MiB", "--metrics-port", "0"]
    with dockd.start_local(1, extra_args=args) as c, dockd.connect(c.address) as w:
        for x in parts:
            w.put({"x": x}, partition="p", device="keep")
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
        with dockd.connect(c.address) as r:
            got = r.get("gpu", ["x"], 64, partition="p", device=f"{kind}:0", timeout=120).stacked("x")
        assert got.device == torch.device(kind, 0)
        assert torch.equal(got.cpu(), torch.cat([x.cpu() for x in parts]))
        assert int(metric(c, "dockd_device_linked_bytes_total")) == 2 * 32 * 4096 * 4  # none as host bytes
