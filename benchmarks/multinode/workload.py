"""The GRPO iteration every layout runs: what each stage writes and reads, and how samples are checked.

Per node and iteration the rollout worker writes ``batch_per_node`` new
samples, ``put_chunk`` per put, each with two columns of ``sample_bytes / 2``:
``responses`` (int32 token ids) and ``log_probs`` (float32, the behaviour
policy's log-probabilities). Three consumer stages run on every node at the
same time and take what they need as it becomes ready, ``get_chunk`` per get,
each until it has ``batch_per_node`` samples:

    reward     reads responses
    reference  reads responses
    trainer    reads responses, log_probs

Stages of the same name on different nodes share one consumer stream, so
each consumer name sees every sample of the iteration exactly once across
the cluster. Every sample carries its origin in its first values (node,
sequence number, iteration; the same in both columns), which the consumers
check and report, so the runner can prove that every sample reached every
consumer once and attribute each read to the warehouse that held it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

COLUMNS = ("responses", "log_probs")
CONSUMERS: dict[str, tuple[str, ...]] = {
    "reward": ("responses",),
    "reference": ("responses",),
    "trainer": ("responses", "log_probs"),
}
STAGES = ("rollout", *CONSUMERS)
HEADER = 3  # node, sequence number within the node's iteration, iteration
KEY_STRIDE = 1_000_000


def sample_key(node: int, seq: int) -> int:
    """One int naming a sample within an iteration: its writer node and sequence number."""
    return node * KEY_STRIDE + seq


def key_node(key: int) -> int:
    return key // KEY_STRIDE


def elements(sample_bytes: int) -> int:
    """Elements per column (4-byte values); each column is half the sample."""
    return sample_bytes // 2 // 4


def make_chunk(node: int, iteration: int, seq0: int, count: int, sample_bytes: int) -> dict[str, Any]:
    """``count`` new samples as two ``[count, T]`` tensors whose rows start with (node, seq, iteration)."""
    import torch

    t = elements(sample_bytes)
    responses = torch.full((count, t), 7, dtype=torch.int32)
    log_probs = torch.full((count, t), -0.5, dtype=torch.float32)
    header = torch.tensor([[node, seq0 + k, iteration] for k in range(count)], dtype=torch.int32)
    responses[:, :HEADER] = header
    log_probs[:, :HEADER] = header.to(torch.float32)
    return {"responses": responses, "log_probs": log_probs}


def check_values(values: dict[str, list[Any]], iteration: int) -> list[int]:
    """Keys of the samples in a get's values; raises if a sample is from another iteration or its columns
    disagree (the warehouse returned the wrong row)."""
    cols = list(values)
    first = values[cols[0]]
    keys = []
    for i, v in enumerate(first):
        node, seq, it = (int(x) for x in v[:HEADER].tolist())
        if it != iteration:
            raise AssertionError(f"sample from iteration {it} delivered in iteration {iteration}")
        for c in cols[1:]:
            other = [int(x) for x in values[c][i][:HEADER].tolist()]
            if other != [node, seq, it]:
                raise AssertionError(f"column {c} of sample {(node, seq, it)} holds the header {other}")
        keys.append(sample_key(node, seq))
    return keys


def value_bytes(values: dict[str, list[Any]]) -> int:
    return sum(int(v.numel() * v.element_size()) for col in values.values() for v in col)


def read_bytes_per_sample(column_bytes: dict[str, int]) -> int:
    """Payload bytes one sample is read with, summed over the consumer stages."""
    return sum(column_bytes[c] for cols in CONSUMERS.values() for c in cols)


def verify_delivery(written: list[int], taken: dict[str, list[int]]) -> dict[str, Any]:
    """Did every consumer name take every written sample exactly once? Returns counts and problems."""
    want = sorted(written)
    out: dict[str, Any] = {"written": len(written), "duplicates_written": len(written) - len(set(written)),
                           "consumers": {}, "ok": len(written) == len(set(written))}
    for name in CONSUMERS:
        got = sorted(taken.get(name, []))
        missing = len(set(want) - set(got))
        dup = len(got) - len(set(got))
        extra = len(set(got) - set(want))
        out["consumers"][name] = {"taken": len(got), "missing": missing, "duplicates": dup, "unknown": extra}
        out["ok"] &= missing == 0 and dup == 0 and extra == 0
    return out
