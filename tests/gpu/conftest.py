"""The accelerators the `gpu` tests run on: the `accel` fixture is "cuda" (NVIDIA) and "npu"
(Ascend, through torch_npu) in turn, each skipped, with the reason, where that kind is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def missing(kind: str) -> str:
    """Why this machine cannot run `kind` device tests ("" when it can)."""
    if kind == "cuda":
        return "" if torch.cuda.is_available() else "needs an NVIDIA GPU with CUDA torch"
    if importlib.util.find_spec("torch_npu") is None:
        return "needs an Ascend NPU with torch_npu"
    import torch_npu  # noqa: F401 - registers torch.npu

    return "" if torch.npu.is_available() else "torch_npu is installed but no NPU is visible"


_WHY = {k: missing(k) for k in ("cuda", "npu")}


@pytest.fixture(params=[pytest.param(k, id=k, marks=pytest.mark.skipif(bool(why), reason=why or "-"))
                        for k, why in _WHY.items()])
def accel(request) -> str:
    return request.param
