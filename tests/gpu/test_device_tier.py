"""The device tier on accelerator memory (CUDA, or Ascend NPUs through torch_npu):
put(device="keep") copies the writer's tensors device to device into the warehouse (another
process, CUDA / NPU IPC), a get(device=...) reads them back the same way, a plain get as host
bytes, a full tier spills to host memory."""

from __future__ import annotations

import pytest
import torch

import dockd

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def test_device_tier_round_trip_and_spill(accel):
    kind, dev = accel, f"{accel}:0"
    x = torch.randn(64, 1024, device=dev).bfloat16()
    rag = [torch.arange(n, dtype=torch.int64, device=dev) for n in (1, 5, 1000, 3)] * 16
    with dockd.start_local(1, extra_args=["--device-capacity", "1MiB"]) as c, dockd.connect(c.address) as d:
        d.put({"x": x, "r": rag, "s": [str(i) for i in range(64)]}, partition="p", device="keep")
        w = d.stats(traffic=True)["warehouses"][0]
        assert w["device_bytes"] == x.numel() * 2 + sum(t.numel() for t in rag) * 8
        x_before = x.clone()
        x.zero_()  # the warehouse holds its own copy
        b = d.get("gpu", ["x", "r", "s"], 64, partition="p", device=dev, timeout=30)
        got = b.stacked("x")
        assert got.device.type == kind and torch.equal(got, x_before)
        assert all(g.device.type == kind and torch.equal(g, w_) for g, w_ in zip(b["r"], rag))
        assert b["s"] == [str(i) for i in range(64)]
        h = d.get("host", ["x", "r"], 64, partition="p", timeout=30)
        assert torch.equal(h.stacked("x"), x_before.cpu())
        big = torch.ones(1024, 1024, device=dev)  # 4 MiB: past the 1 MiB tier, spilled
        d.put({"x": big}, partition="q", device="keep")
        assert d.stats(traffic=True)["warehouses"][0]["device_bytes"] == w["device_bytes"]
        assert torch.equal(d.get("c", ["x"], 1024, partition="q", device=dev, timeout=30).stacked("x"), big)
        d.clear("p")
        assert d.stats(traffic=True)["warehouses"][0]["device_bytes"] == 0
