"""A get whose results go to an accelerator (CUDA, or an NPU through torch_npu): values bit-exact,
on the device, ragged and bf16 included."""

from __future__ import annotations

import pytest
import torch

import dockd

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_get_to_a_device_is_bit_exact(accel):
    values = [torch.randn(n).bfloat16() for n in (3, 1024, 7)]
    ids = [torch.arange(n, dtype=torch.int64) for n in (5, 2, 9)]
    with dockd.start_local(num_warehouses=1) as c, dockd.connect(c.address) as d:
        d.put({"x": values, "ids": ids, "s": ["a", "b", "c"]}, partition="p")
        b = d.get("t", ["x", "ids", "s"], 3, partition="p", device=f"{accel}:0", timeout=10)
        for got, want in zip(b["x"], values):
            assert got.device.type == accel and got.dtype == torch.bfloat16 and torch.equal(got.cpu(), want)
        for got, want in zip(b["ids"], ids):
            assert got.device.type == accel and torch.equal(got.cpu(), want)
        assert b["s"] == ["a", "b", "c"]
