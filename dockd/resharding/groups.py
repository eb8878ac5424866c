"""Process groups used by allgather-swap: training TP, PP and EP groups.

Every rank must build the groups, in the same order (a ``torch.distributed``
rule), so :func:`build_groups` creates all of them on every rank and keeps
the ones this rank belongs to.  A group of size one is not created: no
collective runs over it.

Frameworks that already own these groups (Megatron's ``parallel_state``)
can pass a :class:`ReshardGroups` of their own instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .layout import ParallelLayout

__all__ = ["ReshardGroups", "build_groups"]


@dataclass(kw_only=True, slots=True)
class ReshardGroups:
    """The groups this rank belongs to, with their global ranks in group order.

    Each rank list must be in rank order of its dimension (``pp_ranks[s]`` is
    the member on stage ``s``, ``ep_ranks[e]`` holds experts block ``e``) and
    agree with the tp-dp-pp rank order of :class:`ParallelLayout`;
    :class:`AllGatherSwap` checks this.
    """

    tp_ranks: list[int]
    """Training tensor-parallel group (all-gather of dense parameters)."""
    pp_ranks: list[int]
    """Training pipeline group, stage order (broadcast of each stage's buckets)."""
    ep_ranks: list[int]
    """Training expert-parallel group (all-to-all of expert parameters)."""
    tp: Any = None
    pp: Any = None
    ep: Any = None


def _mine(
    lists: list[list[int]], rank: int, backend: str | None
) -> tuple[list[int], Any]:
    mine: tuple[list[int], Any] | None = None
    for ranks in lists:
        group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (ranks, group)
    assert mine is not None, f"rank {rank} is in no group of {lists}"
    return mine


def build_groups(layout: ParallelLayout, *, backend: str | None = None) -> ReshardGroups:
    """Create the TP, PP and EP groups of ``layout`` over the default world."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    tp_ranks, tp = _mine(layout.tp_groups(world), rank, backend)
    pp_ranks, pp = _mine(layout.pp_groups(world), rank, backend)
    ep_ranks, ep = _mine(layout.ep_groups(world), rank, backend)
    return ReshardGroups(tp_ranks=tp_ranks, pp_ranks=pp_ranks, ep_ranks=ep_ranks, tp=tp, pp=pp, ep=ep)
