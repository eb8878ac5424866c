"""HCCL through dockd.device on Ascend NPUs: the same two-process checks as
tests/gpu/test_nccl_bindings.py (send/recv, broadcast, all_gather), on `npu` devices.

Run on an Ascend machine with CANN and torch_npu installed (source CANN's set_env.sh first):
`pytest -m gpu tests/gpu -q`. Skipped elsewhere, with the reason.
"""

from __future__ import annotations

import importlib.util

import pytest

from dockd.device import DeviceLibraryNotFound, load_hccl_library


def _npu_missing() -> str:
    if importlib.util.find_spec("torch_npu") is None:
        return "needs an Ascend NPU with torch_npu"
    import torch
    import torch_npu  # noqa: F401

    if not torch.npu.is_available():
        return "torch_npu is installed but no NPU is visible"
    try:
        load_hccl_library()
    except DeviceLibraryNotFound as e:
        return str(e)
    return ""


_MISSING = _npu_missing()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_MISSING), reason=_MISSING or "-"),
    pytest.mark.timeout(240),
]


def _run(op: str) -> list[dict]:
    from dockd.device._selftest import run_ranks

    return run_ranks(op, 2, timeout=180, backend="hccl")


@pytest.mark.parametrize("op", ["sendrecv", "broadcast", "all_gather"])
def test_hccl_two_processes(op):
    assert [r["ok"] for r in _run(op)] == [True, True]
