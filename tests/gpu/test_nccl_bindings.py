"""NCCL through dockd.device on a real GPU: send/recv, broadcast, all_gather between two processes.

Run on a GPU machine with `pytest -m gpu tests/gpu -q` (or scripts/gpu_check.py, which also
prints bandwidth figures). With one GPU both ranks share it, each claiming a host of its own
(`dockd.device.own_host_env`: NCCL refuses two ranks on one GPU of one host).
"""

from __future__ import annotations

import pytest
import torch

from dockd.device import DeviceLibraryNotFound, load_nccl_library

_HAS_CUDA = torch.cuda.is_available()


def _nccl_missing() -> str:
    try:
        load_nccl_library()
        return ""
    except DeviceLibraryNotFound as e:
        return str(e)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _HAS_CUDA, reason="needs an NVIDIA GPU with CUDA torch"),
    pytest.mark.timeout(240),
]


@pytest.fixture(scope="module", autouse=True)
def _nccl_present():
    missing = _nccl_missing()
    if missing:
        pytest.skip(missing)


def _run(op: str, **kw) -> list[dict]:
    from dockd.device._selftest import run_ranks

    return run_ranks(op, 2, timeout=180, **kw)


def test_send_recv_two_processes():
    res = _run("sendrecv")
    assert [r["ok"] for r in res] == [True, True]
    assert res[0]["nccl_version"] == res[1]["nccl_version"] >= 20700


def test_broadcast_two_processes():
    assert all(r["ok"] for r in _run("broadcast"))


def test_all_gather_two_processes():
    assert all(r["ok"] for r in _run("all_gather"))


def test_failing_collective_raises_nccl_error_in_process():
    """A bad argument after a real init: NCCL's own message comes back as NcclError (one rank, no peer needed)."""
    from dockd.device import Communicator, NcclError

    torch.cuda.set_device(0)
    comm = Communicator("nccl")
    comm.init(comm.unique_id(), 0, 1, device=0)
    try:
        t = torch.zeros(16, device="cuda:0")
        with pytest.raises(NcclError) as ei:
            comm.lib.send(t.data_ptr(), t.numel(), 7, 5, comm.handle, 0)   # peer 5 of a 1-rank communicator
        assert ei.value.code_name in ("ncclInvalidArgument", "ncclInvalidUsage")
        assert ei.value.library_message in str(ei.value)
        t2 = torch.arange(16, dtype=torch.float32, device="cuda:0")
        comm.broadcast(t2, 0)   # a 1-rank broadcast is a copy in place
        torch.cuda.synchronize()
        assert torch.equal(t2, torch.arange(16, dtype=torch.float32, device="cuda:0"))
    finally:
        comm.destroy()
