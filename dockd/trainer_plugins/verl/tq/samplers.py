"""TransferQueue's samplers on dockd: which samples ``get_meta`` chooses, named by ``conf.controller.sampler``.

A sampler here is the name of a choice and its settings; the choosing is done on the partition's
key log (`dockd.trainer_plugins.verl.tq.consume`), so that every process of a job chooses alike.
`_groups` and `_length` are the choices' building blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SamplingError(ValueError, RuntimeError):
    """A get_meta the sampler refuses (a batch_size that is not a multiple of the group size, a
    RankAwareSampler call without dp_rank). A RuntimeError too, as TransferQueue's client reports
    its controller's errors."""


class BaseSampler:
    """``transfer_queue.BaseSampler``'s place: a sampler here names how `DockTQClient.get_meta`
    chooses, with its settings; the choosing is done by the client on the partition's key log
    (so every process of a job chooses alike), not by a ``sample`` method."""

    def __init__(self) -> None:
        pass

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class SequentialSampler(BaseSampler):
    """TransferQueue's default: the oldest ready samples the task has not taken."""


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of `n_samples_per_prompt` samples at consecutive indexes, all ready (TQ's
    GRPOGroupNSampler: a prompt's responses are put one after another)."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = int(n_samples_per_prompt)


class RankAwareSampler(BaseSampler):
    """Every caller with the same ``sampling_config`` ``dp_rank`` and ``batch_index`` gets the same
    samples (the ranks of one data-parallel group); each dp_rank's batches are its own."""


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """GRPO groups for all `dp_size` ranks of a ``batch_index`` at once, split so that the ranks'
    sums of the samples' ``total_lengths`` tag (default 1) are balanced, groups kept whole;
    ``batch_size`` is per rank."""

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = int(dp_size)


_SAMPLERS: dict[str, type[BaseSampler]] = {
    c.__name__: c for c in (SequentialSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler)
}


def _as_sampler(sampler: Any) -> BaseSampler:
    """A ``conf.controller.sampler`` (a name, a class or an instance; TransferQueue's own classes
    too, recognised by name and read for their settings) as one of this module's samplers."""
    if sampler is None:
        return SequentialSampler()
    if isinstance(sampler, str):
        name = sampler
    elif isinstance(sampler, type):
        name = sampler.__name__
    else:
        name = type(sampler).__name__
    cls = _SAMPLERS.get(name)
    if cls is None:
        raise ValueError(
            f"Could not find sampler {name}: dockd's transfer_queue client samples like TransferQueue's "
            f"{', '.join(_SAMPLERS)} (a custom sampler's sample() is not run here)"
        )
    if isinstance(sampler, (str, type)):
        return cls()
    kwargs = {k: getattr(sampler, k) for k in ("n_samples_per_prompt", "dp_size") if hasattr(sampler, k)}
    return cls(**kwargs)


def _groups(ready: list[int], count: int, n: int) -> list[int]:
    """TQ's GRPOGroupNSampler choice: scanning the ascending `ready` indexes, runs of `n` consecutive
    indexes, until `count` samples; [] when there are not that many runs."""
    if count % n:
        raise SamplingError(f"batch_size ({count}) must be a multiple of n_samples_per_prompt ({n})")
    found: list[int] = []
    i = 0
    while i <= len(ready) - n and len(found) < count:
        if ready[i + n - 1] - ready[i] == n - 1:  # ascending and distinct: n consecutive indexes
            found.extend(ready[i:i + n])
            i += n
        else:
            i += 1
    return found if len(found) == count else []


def _length(tags: dict[str, Any]) -> float:
    """A sample's weight for SeqlenBalancedSampler: its ``total_lengths`` tag, 1 without one."""
    try:
        value = float(tags.get("total_lengths", 1))
    except (TypeError, ValueError):
        return 1.0
    return value if value >= 0 and np.isfinite(value) else 1.0
