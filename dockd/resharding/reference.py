"""Single-process reference: build a full model and slice it by hand.

Used by the tests and the benchmark to create each rank's training shards
and the generation weights every rank must end up with.  The slicing here is
written independently of :func:`~dockd.resharding.layout.plan_reslice`
(``torch.chunk`` per fused block, then ``torch.cat``), so the two check each
other.
"""

from __future__ import annotations

import zlib

import torch

from .layout import ParallelLayout, ParamSpec

__all__ = [
    "build_full_weights",
    "generation_shard",
    "toy_transformer_specs",
    "training_shard",
    "training_shards",
]


def toy_transformer_specs(
    *,
    hidden: int,
    ffn: int,
    layers: int,
    vocab: int,
    kv_hidden: int | None = None,
    experts: int = 0,
    moe_ffn: int | None = None,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
) -> list[ParamSpec]:
    """A decoder stack with every kind of parameter the module handles.

    Per layer: two norms (replicated), fused QKV weight and bias (column,
    blocks ``(hidden, kv, kv)``), output projection (row), and either a dense
    MLP (fused gate/up column + down row) or, with ``experts > 0``, a router
    (replicated) plus expert gate/up and down weights.  A vocab-parallel
    embedding sits on the first stage; final norm and LM head on the last.
    Layers are spread evenly over ``pp`` stages.
    """
    kv = kv_hidden if kv_hidden is not None else hidden
    mf = moe_ffn if moe_ffn is not None else ffn
    specs = [ParamSpec(name="embed.weight", shape=(vocab, hidden), dtype=dtype, tp_dim=0, stage=0)]
    for i in range(layers):
        st = i * pp // layers
        p = f"layers.{i}."
        specs += [
            ParamSpec(name=p + "input_norm.weight", shape=(hidden,), dtype=dtype, stage=st),
            ParamSpec(name=p + "attn.qkv.weight", shape=(hidden + 2 * kv, hidden), dtype=dtype,
                      tp_dim=0, fused=(hidden, kv, kv), stage=st),
            ParamSpec(name=p + "attn.qkv.bias", shape=(hidden + 2 * kv,), dtype=dtype,
                      tp_dim=0, fused=(hidden, kv, kv), stage=st),
            ParamSpec(name=p + "attn.o_proj.weight", shape=(hidden, hidden), dtype=dtype, tp_dim=1, stage=st),
            ParamSpec(name=p + "post_norm.weight", shape=(hidden,), dtype=dtype, stage=st),
        ]
        if experts:
            specs += [
                ParamSpec(name=p + "moe.router.weight", shape=(experts, hidden), dtype=dtype, stage=st),
                ParamSpec(name=p + "moe.experts.gate_up.weight", shape=(2 * mf, hidden), dtype=dtype,
                          tp_dim=0, fused=(mf, mf), stage=st, experts=experts),
                ParamSpec(name=p + "moe.experts.down.weight", shape=(hidden, mf), dtype=dtype,
                          tp_dim=1, stage=st, experts=experts),
            ]
        else:
            specs += [
                ParamSpec(name=p + "mlp.gate_up.weight", shape=(2 * ffn, hidden), dtype=dtype,
                          tp_dim=0, fused=(ffn, ffn), stage=st),
                ParamSpec(name=p + "mlp.down.weight", shape=(hidden, ffn), dtype=dtype, tp_dim=1, stage=st),
            ]
    specs += [
        ParamSpec(name="final_norm.weight", shape=(hidden,), dtype=dtype, stage=pp - 1),
        ParamSpec(name="lm_head.weight", shape=(vocab, hidden), dtype=dtype, tp_dim=0, stage=pp - 1),
    ]
    return specs


def full_shape(spec: ParamSpec) -> tuple[int, ...]:
    return (spec.experts, *spec.shape) if spec.experts else spec.shape


def build_full_weights(specs: list[ParamSpec], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full (unsharded) weights on CPU, one generator per name,
    so every process builds bit-identical tensors."""
    out = {}
    for spec in specs:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
        out[spec.name] = torch.randn(full_shape(spec), generator=g).to(spec.dtype)
    return out


def _tp_slice(t: torch.Tensor, spec: ParamSpec, tp: int, tp_rank: int, dim: int) -> torch.Tensor:
    if spec.tp_dim is None:
        return t.clone()
    blocks = torch.split(t, list(spec.blocks), dim=dim)
    return torch.cat([torch.chunk(b, tp, dim=dim)[tp_rank] for b in blocks], dim=dim).contiguous()


def training_shard(
    full: torch.Tensor, spec: ParamSpec, train: ParallelLayout, world_size: int, rank: int
) -> torch.Tensor:
    """This rank's training shard of one parameter (the rank must own its stage)."""
    c = train.coords(rank, world_size)
    if spec.experts:
        return torch.chunk(full, train.ep, dim=0)[c.ep_rank].clone()
    return _tp_slice(full, spec, train.tp, c.tp_rank, spec.tp_dim or 0)


def training_shards(
    full: dict[str, torch.Tensor], specs: list[ParamSpec], train: ParallelLayout, world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """The update weights ``rank`` holds: the shards of its pipeline stage."""
    stage = train.coords(rank, world_size).pp_rank
    return {s.name: training_shard(full[s.name], s, train, world_size, rank) for s in specs if s.stage == stage}


def generation_shard(full: torch.Tensor, spec: ParamSpec, gen: ParallelLayout, rank: int) -> torch.Tensor:
    """What ``rank`` must hold for this parameter in generation."""
    tp_rank = rank % gen.tp
    if spec.experts:
        dim = spec.tp_dim + 1 if spec.tp_dim is not None else 0
        return _tp_slice(full, spec, gen.tp, tp_rank, dim)
    return _tp_slice(full, spec, gen.tp, tp_rank, spec.tp_dim or 0)
