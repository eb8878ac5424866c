"""The memory model of resharding: weight bytes per device, with and without swap.

Notation (bytes): ``W_d`` dense weights split by TP, ``W_r`` replicated
weights, ``W_e`` expert weights; training ``T = tp``, ``P = pp``, ``E = ep``;
generation ``G = tp``.  For a rank on stage ``s`` (``W[s]`` = that stage's
share, ``W/P`` for an even split)::

    update   U = W_d[s]/T + W_r[s] + W_e[s]/E        training shards
    gen      R = W_d/G + W_r + W_e/G                 generation weights
    naive    U + R                                   during generation
    swap     R                                       during generation
    freed    U ≈ W/(T·P) (experts: W_e/(E·P))
    peak     U + R + max temporary                   inside enter_generation

The largest temporary is one all-gather output (a full dense parameter, or
``tp`` x the rows that fit ``gather_chunk_bytes`` when it is larger) or
one all-to-all send buffer (``W_e(param)/G``).  When the generation TP does
not divide the ranks of a training stage (the ``param_broadcast`` path) it is
the largest whole parameter, which every pipeline peer receives in turn.  :func:`predict_memory`
evaluates these for any spec list; the benchmark checks them against the
module's own accounting.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .layout import (
    DEFAULT_GATHER_CHUNK_BYTES,
    ParallelLayout,
    ParamSpec,
    gather_chunk_rows,
    training_local_shape,
)

__all__ = ["MemoryModel", "predict_memory"]


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryModel:
    """Predicted weight bytes on one rank."""

    rank: int
    update_bytes: int
    """Training shards held by the rank (``U``)."""
    generation_bytes: int
    """Generation weights (``R``)."""
    max_temp_bytes: int
    """Largest temporary buffer of ``enter_generation``."""

    @property
    def naive_generation_bytes(self) -> int:
        return self.update_bytes + self.generation_bytes

    @property
    def swap_generation_bytes(self) -> int:
        return self.generation_bytes

    @property
    def freed_bytes(self) -> int:
        return self.update_bytes

    @property
    def enter_peak_bytes(self) -> int:
        return self.update_bytes + self.generation_bytes + self.max_temp_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            naive_generation_bytes=self.naive_generation_bytes,
            swap_generation_bytes=self.swap_generation_bytes,
            freed_bytes=self.freed_bytes,
            enter_peak_bytes=self.enter_peak_bytes,
        )
        return d


def predict_memory(
    specs: list[ParamSpec],
    train: ParallelLayout,
    gen: ParallelLayout,
    world_size: int,
    rank: int,
    *,
    gather_chunk_bytes: int | None = DEFAULT_GATHER_CHUNK_BYTES,
) -> MemoryModel:
    """Evaluate the memory model for ``rank`` (no bucket alignment padding);
    ``gather_chunk_bytes`` as in ``ReshardConfig``."""
    stage = train.coords(rank, world_size).pp_rank
    per_stage = train.tp * train.dp(world_size)
    param_broadcast = per_stage % gen.tp != 0  # see AllGatherSwap.path
    update = 0
    generation = 0
    temp = 0
    for spec in specs:
        split = spec.tp_dim is not None
        generation += spec.nbytes // gen.tp if split else spec.nbytes
        own = spec.stage == stage
        if own:
            update += spec.nbytes // train.ep if spec.experts else (spec.nbytes // train.tp if split else spec.nbytes)
        if param_broadcast:
            # receivers take every other stage's parameter whole; the owner
            # gathers its own unless the rank already holds it whole
            whole = train.ep == 1 if spec.experts else (not split or train.tp == 1)
            if not own or not whole:
                temp = max(temp, spec.nbytes)
        elif own and spec.experts and train.ep > 1:
            temp = max(temp, spec.nbytes // gen.tp if split else spec.nbytes)  # all-to-all send buffer
        elif own and not spec.experts and split and train.tp > 1:
            rows = gather_chunk_rows(spec, train, gather_chunk_bytes)
            shard_rows = training_local_shape(spec, train)[0]
            temp = max(temp, spec.nbytes // shard_rows * rows)  # all-gather output, chunked
    return MemoryModel(rank=rank, update_bytes=update, generation_bytes=generation, max_temp_bytes=temp)
