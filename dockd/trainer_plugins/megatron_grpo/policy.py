"""megatron-core side of the GRPO loop: parallel state, a tiny GPT, log-probs and sampling.

Only this module imports megatron-core, and only when called. The model is any
module called as ``model(input_ids, position_ids, attention_mask)`` that
returns vocab-parallel logits ``[batch, seq, vocab / tp]`` (megatron's
``GPTModel`` with ``parallel_output=True``).
"""

from __future__ import annotations

import logging
import operator
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist

from dockd.trainer_plugins import require

logger = logging.getLogger(__name__)


def megatron(module: str = "megatron.core") -> Any:
    return require(module, extra="megatron", what="dockd.trainer_plugins.megatron_grpo")


def _cpu_get_tensor(
    self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
) -> torch.Tensor:
    required = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
    out: torch.Tensor = buf[:required].view(*tensor_shape)
    return out


def init_model_parallel(*, tensor_parallel_size: int, seed: int, device: torch.device | str) -> None:
    """Initialise megatron's parallel_state and RNG on an already initialised process group.

    Seeds the host RNG too (the same `seed` on every rank), so models built afterwards
    with ``use_cpu_initialization`` start from the same full weights on every rank and a
    run is repeatable. On CPU, megatron-core 0.16 allocates its global memory buffer on
    the CUDA device and forks CUDA RNG states; both are redirected to CPU here (buffer on
    CPU, the inference RNG tracker, which does not fork device RNG states).
    """
    core = megatron("megatron.core")
    ps = megatron("megatron.core.parallel_state")
    tp = megatron("megatron.core.tensor_parallel")
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        utils = megatron("megatron.core.utils")
        utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    torch.manual_seed(seed)
    tp.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu)
    logger.info(
        "[megatron_grpo] parallel_state tp=%d dp=%d device=%s megatron_core=%s",
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        torch.device(device),
        getattr(core, "__version__", "?"),
    )


def build_tiny_gpt(
    *,
    vocab_size: int,
    max_sequence_length: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
) -> torch.nn.Module:
    """A small megatron-core ``GPTModel`` (local layer spec, no Transformer Engine)."""
    ps = megatron("megatron.core.parallel_state")
    cfg_mod = megatron("megatron.core.transformer.transformer_config")
    gpt = megatron("megatron.core.models.gpt")
    specs = megatron("megatron.core.models.gpt.gpt_layer_specs")
    config = cfg_mod.TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    model: torch.nn.Module = gpt.GPTModel(
        config=config,
        transformer_layer_spec=specs.get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        parallel_output=True,
    )
    return model


def _forward(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
    logits: torch.Tensor = model(input_ids, position_ids, causal)
    return logits


def response_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, prompt_length: int, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(token) of every response token: ``[batch, seq - prompt_length]``.

    Uses megatron's ``vocab_parallel_cross_entropy`` on the vocab-parallel logits, so no
    rank ever holds the full vocabulary.
    """
    tp = megatron("megatron.core.tensor_parallel")
    logits = _forward(model, input_ids)[:, prompt_length - 1 : -1].float() / temperature
    target = input_ids[:, prompt_length:]
    nll: torch.Tensor = tp.vocab_parallel_cross_entropy(logits.contiguous(), target)
    return -nll


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    tp_group: Any,
    tp_src: int,
) -> torch.Tensor:
    """Sample `max_new_tokens` tokens after `prompts` (``[batch, prompt_len]``), TP-parallel.

    Each step gathers the last position's vocab-parallel logits over the TP group, the
    group's first rank samples, and broadcasts the tokens so every rank continues from the
    same sequence. Returns the responses ``[batch, max_new_tokens]``.
    """
    was_training = model.training
    model.eval()
    seq = prompts
    tp_size = dist.get_world_size(tp_group)
    try:
        for _ in range(max_new_tokens):
            last = _forward(model, seq)[:, -1].float().contiguous()
            if tp_size > 1:
                parts = [torch.empty_like(last) for _ in range(tp_size)]
                dist.all_gather(parts, last, group=tp_group)
                last = torch.cat(parts, dim=-1)
            if dist.get_rank() == tp_src:
                probs = torch.softmax(last / temperature, dim=-1)
                token = torch.multinomial(probs.cpu(), 1, generator=generator).to(seq.device)
            else:
                token = torch.empty(seq.shape[0], 1, dtype=seq.dtype, device=seq.device)
            if tp_size > 1:
                dist.broadcast(token, src=tp_src, group=tp_group)
            seq = torch.cat([seq, token.to(seq.dtype)], dim=1)
    finally:
        model.train(was_training)
    return seq[:, prompts.shape[1] :]
