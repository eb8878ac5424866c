"""Native Megatron GRPO loop over dockd (pip install -e '.[megatron]').

A GRPO pipeline whose stages (rollout, reward, reference log-prob, old
log-prob, advantage, update) exchange samples only through the dock, in
MindSpeed-RL's column/consumer layout (`Columns`, `Consumers`). Model stages
run tensor-parallel on megatron-core's ``parallel_state``; within a TP group
one rank fetches and broadcasts the batch (`comm.TPReader`). The collective
backend follows the device (`collective_backend`): gloo on CPU, NCCL on CUDA,
HCCL on Ascend NPU.

    init_model_parallel(tensor_parallel_size=2, seed=1, device="cpu")
    actor, reference = (build_tiny_gpt(vocab_size=16, max_sequence_length=16) for _ in range(2))
    reference.load_state_dict(actor.state_dict())
    pipe = GRPOPipeline(dock_address=addr, actor=actor, reference=reference,
                        optimizer=torch.optim.Adam(actor.parameters(), 1e-3),
                        reward_fn=..., prompt_fn=..., config=GRPOConfig())
    pipe.run(steps=40)

See examples/grpo_tiny.py for a complete run. megatron-core is imported only
when a model or the pipeline is built.
"""

from __future__ import annotations

from dockd.trainer_plugins.megatron_grpo.comm import LocalBatch, TPReader, broadcast_batch, collective_backend
from dockd.trainer_plugins.megatron_grpo.config import Columns, Consumers, GRPOConfig
from dockd.trainer_plugins.megatron_grpo.pipeline import GRPOPipeline, StepMetrics
from dockd.trainer_plugins.megatron_grpo.policy import (
    build_tiny_gpt,
    generate,
    init_model_parallel,
    response_log_probs,
)
from dockd.trainer_plugins.megatron_grpo.stages import (
    AdvantageStage,
    LogProbStage,
    RewardStage,
    RolloutStage,
    StageContext,
    UpdateStage,
)

__all__ = [
    "AdvantageStage",
    "Columns",
    "Consumers",
    "GRPOConfig",
    "GRPOPipeline",
    "LocalBatch",
    "LogProbStage",
    "RewardStage",
    "RolloutStage",
    "StageContext",
    "StepMetrics",
    "TPReader",
    "UpdateStage",
    "broadcast_batch",
    "build_tiny_gpt",
    "collective_backend",
    "generate",
    "init_model_parallel",
    "response_log_probs",
]
