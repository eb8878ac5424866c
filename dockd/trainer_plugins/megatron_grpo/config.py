"""Typed configuration of the Megatron GRPO pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class Columns:
    """Column names, as in MindSpeed-RL's GRPO transfer dock."""

    prompts: str = "prompts"
    prompt_length: str = "prompt_length"
    responses: str = "responses"
    response_length: str = "response_length"
    input_ids: str = "input_ids"
    rm_scores: str = "rm_scores"
    old_log_prob: str = "old_log_prob"
    ref_log_prob: str = "ref_log_prob"
    advantages: str = "advantages"


@dataclass(kw_only=True, slots=True)
class Consumers:
    """Consumer names, one per stage, as in MindSpeed-RL's GRPO transfer dock."""

    rollout: str = "actor_rollout"
    reward: str = "rule_reward"
    ref_log_prob: str = "ref_log_prob"
    old_log_prob: str = "actor_log_prob"
    advantage: str = "compute_advantage"
    update: str = "actor_train"


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """One GRPO run: batch shape, algorithm knobs, and how the TP group reads the dock."""

    prompts_per_step: int = 16
    """Prompts per iteration; each is expanded to `group_size` samples."""
    group_size: int = 8
    """Responses per prompt (GRPO's n); one dock group."""
    max_response_length: int = 8
    """Tokens generated per response."""
    temperature: float = 1.0
    """Sampling temperature of the rollout stage."""
    lr: float = 1e-3
    """Adam learning rate of the update stage."""
    clip_eps: float = 0.2
    """PPO ratio clip."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference policy (0 disables the reference stage's effect)."""
    update_epochs: int = 1
    """Passes of the update stage over each step's samples."""
    micro_batch_size: int = 0
    """Samples per forward/backward in the update stage; 0 = the whole step at once."""
    tp_fetch: Literal["broadcast", "shared", "group"] = "group"
    """How a tensor-parallel group reads a batch: ``"group"`` (every rank gets the batch
    itself with a model-parallel get, no collective; measured fastest, see docs/plugins.md),
    ``"shared"`` (the group's first rank acquires, broadcasts only the lease, every rank
    fetches the data itself) or ``"broadcast"`` (the first rank fetches and broadcasts the
    data over the collective backend)."""
    get_timeout: float = 120.0
    """Seconds a stage waits for its samples before DockTimeout."""
    seed: int = 1234
    """Seed of sampling and of the model's initialisation."""
    columns: Columns = field(default_factory=Columns)
    consumers: Consumers = field(default_factory=Consumers)

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_response_length", "update_epochs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GRPOConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(
                f"GRPOConfig.group_size must be >= 2: GRPO normalises rewards within a group, got {self.group_size}"
            )
        if self.temperature <= 0:
            raise ValueError(f"GRPOConfig.temperature must be > 0, got {self.temperature}")
        if self.tp_fetch not in ("broadcast", "shared", "group"):
            raise ValueError(f"GRPOConfig.tp_fetch must be 'broadcast', 'shared' or 'group', got {self.tp_fetch!r}")
        if self.micro_batch_size < 0:
            raise ValueError(f"GRPOConfig.micro_batch_size must be >= 0, got {self.micro_batch_size}")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size
