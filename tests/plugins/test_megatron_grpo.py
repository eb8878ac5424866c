"""Megatron GRPO plugin: TP reads of the dock over gloo, and the tiny GRPO run (examples/grpo_tiny.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import dockd

pytest.importorskip("megatron.core")

from dockd.trainer_plugins.megatron_grpo import GRPOConfig, collective_backend  # noqa: E402
from dockd.trainer_plugins.megatron_grpo.comm import LocalBatch, _pack, _unpack  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _run_script(tmp_path: Path, code: str, *args: str, timeout: float = 180.0) -> str:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_backend_follows_the_device() -> None:
    assert collective_backend("cpu") == "gloo"
    assert collective_backend(torch.device("cuda", 0)) == "nccl"
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="torch_npu"):
            collective_backend("npu")
    else:
        assert collective_backend("npu") == "hccl"
    with pytest.raises(ValueError, match="no collective backend"):
        collective_backend("meta")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="tp_fetch"):
        GRPOConfig(tp_fetch="scatter")  # type: ignore[arg-type]
    assert GRPOConfig(prompts_per_step=4, group_size=8).samples_per_step == 32


def test_broadcast_packing_is_bit_exact() -> None:
    batch = LocalBatch(
        indexes=[3, 4, 9],
        columns={
            "responses": [torch.arange(5), torch.arange(2), torch.empty(0, dtype=torch.int64)],
            "logp": [torch.randn(4).bfloat16(), torch.randn(1).bfloat16(), torch.randn(3).bfloat16()],
            "score": [torch.tensor(1.5), torch.tensor(-2.0), torch.tensor(0.0)],
            "meta": [{"a": 1}, "text", None],
        },
    )
    header, payload = _pack(batch)
    back = _unpack(header, payload)
    assert back.indexes == batch.indexes
    for col, values in batch.columns.items():
        for got, want in zip(back.columns[col], values):
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            else:
                assert got == want


def test_stage_batches_hold_equal_shaped_columns_as_one_tensor(dock: dockd.Dock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's batch holds a column of equal shapes as the one tensor the dock handed over (no tensor
    per value, no torch.stack), and the broadcast carries it as one chunk, bit-exact."""
    from dockd.trainer_plugins.megatron_grpo.comm import to_local
    from dockd.trainer_plugins.megatron_grpo.stages import _stack

    ids = torch.arange(24).view(4, 6)
    logp = torch.randn(4, 3).bfloat16()
    dock.put({"input_ids": ids, "old_log_prob": logp, "note": ["a", "b", "c", "d"]}, partition="mg-stacked")

    def per_value(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a column was stacked from a tensor per value")

    monkeypatch.setattr(torch, "stack", per_value)
    batch = dock.get("c", ["input_ids", "old_log_prob", "note"], 4, partition="mg-stacked", timeout=5.0)
    local = to_local(batch, ["input_ids", "old_log_prob", "note"])
    assert torch.equal(_stack(local, "input_ids", torch.device("cpu")), ids)
    back = _unpack(*_pack(local))
    assert torch.equal(back.stacked("old_log_prob").view(torch.int16), logp.view(torch.int16))
    assert back["note"] == ["a", "b", "c", "d"] and [int(v[0]) for v in back["input_ids"]] == [0, 6, 12, 18]
    dock.clear("mg-stacked")


TP_READ = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import dockd
from dockd.trainer_plugins.megatron_grpo.comm import TPReader

def expected(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(int(torch.randint(1, 9, (1,), generator=g)), generator=g).to(torch.bfloat16)

def worker(rank, address, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    dock = dockd.connect(address)
    if rank == 0:
        dock.put({"x": [expected(i) for i in range(12)], "n": torch.arange(12)}, partition="tp", group_size=4)
    dist.barrier()
    for mode, want in (("broadcast", [0, 1, 2, 3]), ("shared", [4, 5, 6, 7]), ("group", [8, 9, 10, 11])):
        reader = TPReader(dock, mode=mode, tp_group=group, tp_src=0, tp_rank=rank)
        b = reader.get(consumer="stage", columns=["x", "n"], count=4, partition="tp", groups=True, timeout=10)
        assert b.indexes == want, (mode, b.indexes)
        for i, x, n in zip(b.indexes, b["x"], b["n"]):
            e = expected(i)
            assert x.dtype == torch.bfloat16 and torch.equal(x, e) and int(n) == i
    dist.barrier()
    dock.stats()  # (this rank's confirms go out with it)
    dist.barrier()
    if rank == 0:  # one TP group is one consumer: all 12 taken once, none leased
        part = dock.stats()["partitions"]["tp"]
        assert part["consumers"]["stage"] == {"taken": 12, "leased": 0, "ready": 0, "waiting": 0}, part
        print("OK")
    dock.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    address, port = sys.argv[1], int(sys.argv[2])
    mp.start_processes(worker, args=(address, port), nprocs=2, join=True, start_method="spawn")
"""


def test_tp_group_reads_the_same_batch_both_ways(tmp_path: Path, dock_cluster: dockd.LocalCluster) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run_script(tmp_path, TP_READ, dock_cluster.address, str(port))
    assert "OK" in out


@pytest.mark.slow
def test_grpo_tiny_reward_rises(tmp_path: Path) -> None:
    """The example end to end: TP=2 over gloo, two processes, every stage through the dock."""
    curve, png = tmp_path / "curve.json", tmp_path / "curve.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(REPO / "examples" / "grpo_tiny.py"),
            "--steps",
            "40",
            "--json",
            str(curve),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(curve.read_text())
    rewards = result["reward"]
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    # a random policy scores ~1/16; a loop that does not learn (or learns the wrong sign) stays near it
    assert first < 0.2, rewards
    assert last > first + 0.2, f"reward did not rise: first10={first:.3f} last10={last:.3f}\n{rewards}"
    assert png.stat().st_size > 10_000
    assert "mean reward: first 10 steps" in proc.stdout
    # every stage ran through the dock each step
    stages = set(result["stage_seconds"][0])
    assert {"rollout", "reward", "ref_log_prob", "old_log_prob", "advantage", "update"} <= stages
