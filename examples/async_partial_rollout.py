"""Partial rollouts across weight updates, on CPU in a few seconds.

A rollout worker generates responses token by token. When the trainer publishes new weights
mid-rollout, the worker stops, stores its unfinished samples (the tokens so far and the policy
versions that made them) in a partition of their own, loads the new weights, and resumes those
samples first (oldest version first) before starting new prompts. Each finished sample records
every version that produced it; the trainer reads finished samples with a staleness bound.

    python examples/async_partial_rollout.py
"""

from __future__ import annotations

import random

import torch

import dockd

PROMPTS_PER_ROUND = 8
TOKENS_PER_TICK = 3       # tokens the rollout makes before it looks for new weights
MAX_STALENESS = 2         # the trainer takes samples at most this many versions old


def generate(tokens: torch.Tensor, n: int, version: int) -> torch.Tensor:
    """A stand-in policy: n more tokens (their value is the version that made them)."""
    return torch.cat([tokens, torch.full((n,), version, dtype=torch.int64)])


def main() -> None:
    rng = random.Random(0)
    with dockd.start_local(num_warehouses=1) as cluster, dockd.connect(cluster.address) as dock:
        dock.create_partition("partial")  # unfinished samples, resumed by the rollout
        dock.create_partition("finished", max_staleness=MAX_STALENESS, retire_stale=True,
                              max_pending=4 * PROMPTS_PER_ROUND, retire_when_consumed_by=["actor_train"])
        version, trained, resumed_total = 0, 0, 0
        for rnd in range(6):
            # 1. resume what the last weight update interrupted, oldest version first
            work = []
            left = dock.list("partial")["indexes"]
            if left:
                b = dock.get("rollout", ["tokens", "versions", "target"], len(left), partition="partial",
                             order_by="version", timeout=5)
                dock.delete("partial", b.indexes)
                work += [(t, list(v), n) for t, v, n in zip(b["tokens"], b["versions"], b["target"])]
                resumed_total += len(work)
            # 2. then new prompts
            work += [(torch.randint(100, 200, (4,)), [], rng.randint(4, 12)) for _ in range(PROMPTS_PER_ROUND)]
            # 3. generate until the trainer publishes new weights (here: after a few ticks)
            ticks = rng.randint(1, 3)
            for _ in range(ticks):
                work = [(generate(t, TOKENS_PER_TICK, version), v if v[-1:] == [version] else v + [version], n)
                        for t, v, n in work]
            done = [(t, v) for t, v, n in work if len(t) - 4 >= n]
            unfinished = [(t, v, n) for t, v, n in work if len(t) - 4 < n]
            if done:  # a finished sample's version: the oldest policy that produced part of it
                dock.put({"tokens": [t for t, _ in done], "versions": [v for _, v in done]}, partition="finished",
                         tags={"version": [v[0] for _, v in done]}, timeout=10)
            if unfinished:
                dock.put({"tokens": [t for t, _, _ in unfinished], "versions": [v for _, v, _ in unfinished],
                          "target": [n for _, _, n in unfinished]}, partition="partial",
                         tags={"version": [v[0] for _, v, _ in unfinished]})
            # 4. the trainer: one update on what is fresh enough, then new weights
            batch = dock.get("actor_train", ["tokens", "versions"], PROMPTS_PER_ROUND, partition="finished",
                             allow_partial=True, timeout=5)
            trained += len(batch.indexes)
            mixed = sum(len(v) > 1 for v in batch["versions"])
            version += 1  # noqa: SIM113 - the policy version, which a round advances
            dock.set_version("finished", version)
            print(f"round {rnd}: trained on {len(batch.indexes)} samples ({mixed} spanning versions, e.g. "
                  f"{next((v for v in batch['versions'] if len(v) > 1), batch['versions'][0])}), "
                  f"{len(unfinished)} left unfinished, now version {version}")
        st = dock.stats()["partitions"]["finished"]
        print(f"trained on {trained} samples, resumed {resumed_total} partial rollouts; "
              f"dropped as too stale: {st['stale_retired']}, pending: {st['pending']}")


if __name__ == "__main__":
    main()
