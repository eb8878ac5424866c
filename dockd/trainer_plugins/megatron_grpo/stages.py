"""The GRPO stages. Each one reads its inputs from the dock and writes its outputs back.

    stage          consumer            reads                                    writes
    rollout        actor_rollout       prompts                                  responses, response_length, input_ids
    reward         rule_reward         prompts, responses                       rm_scores
    ref log-prob   ref_log_prob        input_ids, prompt_length                 ref_log_prob
    old log-prob   actor_log_prob      input_ids, prompt_length                 old_log_prob
    advantage      compute_advantage   rm_scores (whole groups)                 advantages
    update         actor_train         input_ids, prompt_length, old_log_prob,  (model weights)
                                       ref_log_prob, advantages

Model stages run on every rank of a tensor-parallel group and read through a
`TPReader` (one fetch + broadcast, or every rank reads); only the group's
first rank writes. Reward and advantage are plain functions of the data and
run on one rank. No stage hands data to another except through the dock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dockd.trainer_plugins.megatron_grpo.comm import LocalBatch, TPReader
from dockd.trainer_plugins.megatron_grpo.config import GRPOConfig
from dockd.trainer_plugins.megatron_grpo.policy import generate, response_log_probs

logger = logging.getLogger(__name__)

RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(prompts [n, P], responses [n, R]) -> scores [n] float: a verifiable reward."""


@dataclass(slots=True)
class StageContext:
    """What every stage of one rank shares."""

    dock: Any
    reader: TPReader
    config: GRPOConfig
    tp_group: Any
    tp_src: int
    device: torch.device
    dp_group: Any = None
    """Data-parallel group of this rank; gradients are averaged over it when it has > 1 rank."""

    @property
    def writes(self) -> bool:
        """True on the rank that writes a TP group's outputs (its first rank)."""
        return dist.get_rank() == self.tp_src

    def get_tp(self, partition: str, consumer: str, columns: list[str], count: int, groups: bool = True) -> LocalBatch:
        return self.reader.get(
            consumer=consumer,
            columns=columns,
            count=count,
            partition=partition,
            groups=groups,
            timeout=self.config.get_timeout,
        )


def _stack(batch: Any, column: str, device: torch.device) -> torch.Tensor:
    """A column of equal-shaped tensors as one [n, ...] tensor on `device`, from the buffer the batch holds."""
    return batch.stacked(column).to(device)


class RolloutStage:
    """Generates `group_size` responses per prompt with the actor."""

    def __init__(self, ctx: StageContext, actor: torch.nn.Module) -> None:
        self.ctx = ctx
        self.actor = actor
        self.generator = torch.Generator().manual_seed(ctx.config.seed + dist.get_rank())

    def run(self, partition: str, count: int) -> None:
        c, cfg = self.ctx.config.columns, self.ctx.config
        batch = self.ctx.get_tp(partition, cfg.consumers.rollout, [c.prompts], count)
        prompts = _stack(batch, c.prompts, self.ctx.device)
        responses = generate(
            self.actor,
            prompts,
            max_new_tokens=cfg.max_response_length,
            temperature=cfg.temperature,
            generator=self.generator,
            tp_group=self.ctx.tp_group,
            tp_src=self.ctx.tp_src,
        )
        if self.ctx.writes:
            n = len(batch.indexes)
            self.ctx.dock.put(
                {
                    c.responses: responses.cpu(),
                    c.response_length: torch.full((n,), responses.shape[1], dtype=torch.int64),
                    c.input_ids: torch.cat([prompts, responses], dim=1).cpu(),
                },
                partition=partition,
                indexes=batch.indexes,
            )


class RewardStage:
    """Scores responses with a rule (verifiable reward); runs on one rank."""

    def __init__(self, ctx: StageContext, reward_fn: RewardFn) -> None:
        self.ctx = ctx
        self.reward_fn = reward_fn

    def run(self, partition: str, count: int) -> torch.Tensor:
        c, cfg = self.ctx.config.columns, self.ctx.config
        batch = self.ctx.dock.get(
            consumer=cfg.consumers.reward,
            columns=[c.prompts, c.responses],
            count=count,
            partition=partition,
            timeout=cfg.get_timeout,
        )
        scores = self.reward_fn(batch.stacked(c.prompts), batch.stacked(c.responses)).float()
        if scores.shape != (len(batch.indexes),):
            raise ValueError(
                f"reward_fn must return one score per sample, shape ({len(batch.indexes)},), got {tuple(scores.shape)}"
            )
        self.ctx.dock.put({c.rm_scores: scores}, partition=partition, indexes=batch.indexes)
        return scores


class LogProbStage:
    """Per-token log-probs of the responses under a model (reference or old actor)."""

    def __init__(self, ctx: StageContext, model: torch.nn.Module, *, consumer: str, output: str) -> None:
        self.ctx = ctx
        self.model = model
        self.consumer = consumer
        self.output = output

    @torch.no_grad()
    def run(self, partition: str, count: int) -> None:
        c = self.ctx.config.columns
        batch = self.ctx.get_tp(partition, self.consumer, [c.input_ids, c.prompt_length], count)
        input_ids = _stack(batch, c.input_ids, self.ctx.device)
        prompt_length = int(batch[c.prompt_length][0])
        was_training = self.model.training
        self.model.eval()
        logp = response_log_probs(self.model, input_ids, prompt_length, self.ctx.config.temperature)
        self.model.train(was_training)
        if self.ctx.writes:
            self.ctx.dock.put({self.output: logp.cpu()}, partition=partition, indexes=batch.indexes)


class AdvantageStage:
    """GRPO advantages: each reward normalised within its group; runs on one rank."""

    def __init__(self, ctx: StageContext, eps: float = 1e-6) -> None:
        self.ctx = ctx
        self.eps = eps

    def run(self, partition: str, count: int) -> None:
        c, cfg = self.ctx.config.columns, self.ctx.config
        batch = self.ctx.dock.get(
            consumer=cfg.consumers.advantage,
            columns=[c.rm_scores],
            count=count,
            partition=partition,
            groups=True,
            timeout=cfg.get_timeout,
        )
        scores = batch.stacked(c.rm_scores).view(-1, cfg.group_size)
        adv = (scores - scores.mean(dim=1, keepdim=True)) / (scores.std(dim=1, keepdim=True) + self.eps)
        self.ctx.dock.put({c.advantages: adv.reshape(-1)}, partition=partition, indexes=batch.indexes)


class UpdateStage:
    """PPO-clip policy-gradient step with GRPO advantages and an optional k3 KL to the reference."""

    def __init__(self, ctx: StageContext, actor: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.ctx = ctx
        self.actor = actor
        self.optimizer = optimizer

    def run(self, partition: str, count: int) -> dict[str, float]:
        c, cfg = self.ctx.config.columns, self.ctx.config
        batch = self.ctx.get_tp(
            partition,
            cfg.consumers.update,
            [c.input_ids, c.prompt_length, c.old_log_prob, c.ref_log_prob, c.advantages],
            count,
        )
        dev = self.ctx.device
        input_ids = _stack(batch, c.input_ids, dev)
        prompt_length = int(batch[c.prompt_length][0])
        old = _stack(batch, c.old_log_prob, dev)
        ref = _stack(batch, c.ref_log_prob, dev)
        adv = _stack(batch, c.advantages, dev).view(-1, 1)
        n = input_ids.shape[0]
        mb = cfg.micro_batch_size or n
        self.actor.train()
        metrics = {"loss": 0.0, "kl": 0.0, "clipfrac": 0.0}
        for _ in range(cfg.update_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, n, mb):
                sl = slice(start, start + mb)
                logp = response_log_probs(self.actor, input_ids[sl], prompt_length, cfg.temperature)
                ratio = torch.exp(logp - old[sl])
                surr = torch.minimum(ratio * adv[sl], ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv[sl])
                kl = torch.exp(ref[sl] - logp) - (ref[sl] - logp) - 1  # k3 estimator
                loss = (-surr + cfg.kl_coef * kl).mean() * (logp.shape[0] / n)
                loss.backward()
                metrics["loss"] += float(loss.detach())
                metrics["kl"] += float(kl.detach().mean()) * logp.shape[0] / n
                metrics["clipfrac"] += float(((ratio.detach() - 1).abs() > cfg.clip_eps).float().mean()) * logp.shape[0] / n
            self._average_gradients()
            self.optimizer.step()
        return {k: v / cfg.update_epochs for k, v in metrics.items()}

    def _average_gradients(self) -> None:
        group = self.ctx.dp_group
        if group is None or dist.get_world_size(group) == 1:
            return
        world = dist.get_world_size(group)
        for p in self.actor.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)
