"""The GRPO driver: one iteration = prompts in, six stages through the dock, partition cleared."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import dockd
from dockd.trainer_plugins.megatron_grpo.comm import TPReader
from dockd.trainer_plugins.megatron_grpo.config import GRPOConfig
from dockd.trainer_plugins.megatron_grpo.policy import megatron
from dockd.trainer_plugins.megatron_grpo.stages import (
    AdvantageStage,
    LogProbStage,
    RewardFn,
    RewardStage,
    RolloutStage,
    StageContext,
    UpdateStage,
)

logger = logging.getLogger(__name__)

PromptFn = Callable[[int, int], torch.Tensor]
"""(step, count) -> prompts [count, prompt_len] int64 token ids."""


@dataclass(slots=True)
class StepMetrics:
    step: int
    reward_mean: float
    loss: float
    kl: float
    clipfrac: float
    seconds: float
    stage_seconds: dict[str, float]


class GRPOPipeline:
    """GRPO over megatron-core models whose stages exchange samples only through the dock.

    Call on every rank after `init_model_parallel`. Global rank 0 also feeds prompts and
    runs the reward and advantage stages; the first rank of each tensor-parallel group
    writes that group's outputs; data-parallel groups share consumers, so each takes a
    disjoint share of every step's samples.

    Args:
        dock_address: ``host:port`` of the dock (every rank connects itself).
        actor: the policy being trained (vocab-parallel logits, see `policy`).
        reference: a frozen copy of the initial policy.
        optimizer: optimizer over ``actor.parameters()``.
        reward_fn: verifiable reward, ``(prompts, responses) -> scores [n]``.
        prompt_fn: ``(step, count) -> prompts [count, prompt_len]``.
        config: `GRPOConfig`.
        device: this rank's device (``cpu``, ``cuda:N``, ``npu:N``).
        partition_prefix: partitions are ``"{prefix}/step-{k}"``.
    """

    def __init__(
        self,
        *,
        dock_address: str,
        actor: torch.nn.Module,
        reference: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        reward_fn: RewardFn,
        prompt_fn: PromptFn,
        config: GRPOConfig,
        device: torch.device | str = "cpu",
        partition_prefix: str = "grpo",
    ) -> None:
        ps = megatron("megatron.core.parallel_state")
        self.config = config
        self.prompt_fn = prompt_fn
        self.partition_prefix = partition_prefix
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        if config.samples_per_step % (self.dp_size * config.group_size):
            raise ValueError(
                f"samples per step ({config.samples_per_step}) must split into whole groups of {config.group_size} "
                f"over {self.dp_size} data-parallel groups; change prompts_per_step"
            )
        self.per_dp = config.samples_per_step // self.dp_size
        self.dock = dockd.connect(dock_address)
        tp_group = ps.get_tensor_model_parallel_group()
        tp_src = ps.get_tensor_model_parallel_src_rank()
        reader = TPReader(
            self.dock,
            mode=config.tp_fetch,
            tp_group=tp_group,
            tp_src=tp_src,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            device=self.device,
        )
        ctx = StageContext(
            dock=self.dock,
            reader=reader,
            config=config,
            tp_group=tp_group,
            tp_src=tp_src,
            device=self.device,
            dp_group=ps.get_data_parallel_group(),
        )
        self.ctx = ctx
        for p in reference.parameters():
            p.requires_grad_(False)
        cons, cols = config.consumers, config.columns
        self.rollout = RolloutStage(ctx, actor)
        self.reward = RewardStage(ctx, reward_fn)
        self.ref_log_prob = LogProbStage(ctx, reference, consumer=cons.ref_log_prob, output=cols.ref_log_prob)
        self.old_log_prob = LogProbStage(ctx, actor, consumer=cons.old_log_prob, output=cols.old_log_prob)
        self.advantage = AdvantageStage(ctx)
        self.update = UpdateStage(ctx, actor, optimizer)
        self.history: list[StepMetrics] = []

    def partition(self, step: int) -> str:
        return f"{self.partition_prefix}/step-{step}"

    def _feed(self, partition: str, step: int) -> None:
        cfg = self.config
        prompts = self.prompt_fn(step, cfg.prompts_per_step).to(torch.int64).cpu()
        expanded = prompts.repeat_interleave(cfg.group_size, dim=0)
        lengths = torch.full((expanded.shape[0],), prompts.shape[1], dtype=torch.int64)
        self.dock.put(
            {cfg.columns.prompts: expanded, cfg.columns.prompt_length: lengths},
            partition=partition,
            group_size=cfg.group_size,
        )

    def step(self, step: int) -> StepMetrics:
        """Run one GRPO iteration on every rank; returns the same metrics everywhere."""
        cfg = self.config
        partition = self.partition(step)
        times: dict[str, float] = {}
        t0 = last = time.perf_counter()

        def mark(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            times[name] = now - last
            last = now

        driver = self.rank == 0
        scores = torch.zeros(1)
        if driver:
            self._feed(partition, step)
        mark("feed")
        self.rollout.run(partition, self.per_dp)
        mark("rollout")
        if driver:
            scores = self.reward.run(partition, cfg.samples_per_step)
        mark("reward")
        self.ref_log_prob.run(partition, self.per_dp)
        mark("ref_log_prob")
        self.old_log_prob.run(partition, self.per_dp)
        mark("old_log_prob")
        if driver:
            self.advantage.run(partition, cfg.samples_per_step)
        mark("advantage")
        update = self.update.run(partition, self.per_dp)
        mark("update")
        shared = torch.tensor([float(scores.mean()) if driver else 0.0], device=self.device)
        dist.broadcast(shared, src=0)  # doubles as the barrier before the partition is freed
        if driver:
            self.dock.clear(partition)
        mark("clear")
        metrics = StepMetrics(
            step=step,
            reward_mean=float(shared.item()),
            loss=update["loss"],
            kl=update["kl"],
            clipfrac=update["clipfrac"],
            seconds=time.perf_counter() - t0,
            stage_seconds=times,
        )
        self.history.append(metrics)
        logger.info(
            "[megatron_grpo] step=%d reward_mean=%.3f loss=%.4f seconds=%.2f",
            step,
            metrics.reward_mean,
            metrics.loss,
            metrics.seconds,
        )
        return metrics

    def run(self, steps: int, on_step: Callable[[StepMetrics], Any] | None = None) -> list[StepMetrics]:
        for k in range(steps):
            m = self.step(k)
            if on_step is not None:
                on_step(m)
        return self.history

    def close(self) -> None:
        self.dock.close()
