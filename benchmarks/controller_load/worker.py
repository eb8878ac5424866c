"""One client process of the load benchmark: ``python -m benchmarks.controller_load.worker``.

Runs many simulated workers on one asyncio loop, each an ``AsyncDock``
(dockd's real client, over the real protocol): rollout workers put one
trajectory at a time to their partition, trainers take small gets (1..8
samples, ``allow_partial``) of theirs; a get is acquire at the controller,
fetch from the warehouse, confirm.

The driver sends one JSON object per line on stdin; the worker answers each
with one JSON line on stdout (its logs go to stderr)::

    {"cmd": "setup", "address": "H:P", "rollouts": R, "trainers": T, "partitions": [...], ...}
    {"cmd": "prefill", "per_partition": N}
    {"cmd": "step", "put_rate": r, "get_rate": g, "start_at": MONOTONIC, "duration": s}
    {"cmd": "exit"}

A step is open loop: arrivals are scheduled at fixed intervals from
``start_at`` (on the system-wide monotonic clock, so every process starts
together) whatever the answers do, and a request's latency runs from its
scheduled time to its answer, so falling behind shows up as latency, not
as a lower offered rate. Requests still unanswered 5 s after the step's end
count as late (their latency is recorded as that wait).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import sys
import time
import traceback
from typing import Any

logger = logging.getLogger("benchmarks.controller_load.worker")

MAX_IN_FLIGHT = 4000
"""Arrivals beyond this many unanswered requests are dropped (counted): the process would only queue them."""
DRAIN_S = 5.0


def trajectory(rng: random.Random, spec: dict[str, int]) -> dict[str, list[Any]]:
    """One sample: int32 tokens and float32 log-probs of ``spec`` bytes each, and a float reward."""
    import torch

    tokens = torch.randint(0, 32000, (max(1, spec["tokens_bytes"] // 4),), dtype=torch.int32)
    logp = torch.randn(max(1, spec["logp_bytes"] // 4), dtype=torch.float32)
    return {"tokens": [tokens], "logp": [logp], "reward": [rng.random()]}


class Worker:
    def __init__(self) -> None:
        self.rollouts: list[Any] = []  # AsyncDock each
        self.trainers: list[Any] = []
        self.parts: list[str] = []
        self.pairs: list[tuple[str, str]] = []
        self.spec: dict[str, int] = {}
        self.rng = random.Random(os.getpid())
        self.payload: dict[str, list[Any]] = {}

    async def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        import dockd

        self.spec = {"tokens_bytes": int(msg["tokens_bytes"]), "logp_bytes": int(msg["logp_bytes"])}
        self.payload = trajectory(self.rng, self.spec)
        parts, consumers = list(msg["partitions"]), list(msg["consumers"])
        first_r, first_t = int(msg.get("first_rollout", 0)), int(msg.get("first_trainer", 0))
        conc = int(msg.get("max_concurrency", 16))
        kw: dict[str, Any] = {}
        if msg.get("warehouse") is not None:
            kw["warehouse"] = msg["warehouse"]
        docks = []
        for i in range(int(msg["rollouts"])):
            d = await dockd.connect_async(msg["address"], max_concurrency=conc, name=f"rollout{first_r + i}", **kw)
            docks.append(d)
            self.rollouts.append(d)
        for i in range(int(msg["trainers"])):
            d = await dockd.connect_async(msg["address"], max_concurrency=conc, name=f"trainer{first_t + i}", **kw)
            docks.append(d)
            self.trainers.append(d)
        # puts cycle over the partitions and gets over every (consumer, partition) pair, whichever client
        # carries them, so every stream gets the same share of the load in every process
        self.parts = parts
        self.pairs = [(c, p) for p in parts for c in consumers]
        self.docks = docks
        return {"rollouts": len(self.rollouts), "trainers": len(self.trainers)}

    async def prefill(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Put ``per_partition`` samples into every partition this process writes (once per partition)."""
        import torch

        n = int(msg["per_partition"])
        done: list[str] = []
        for part in self.parts if n > 0 else []:
            dock = self.rollouts[len(done) % len(self.rollouts)]
            done.append(part)
            cols = {"tokens": torch.zeros(n, self.spec["tokens_bytes"] // 4, dtype=torch.int32),
                    "logp": torch.zeros(n, self.spec["logp_bytes"] // 4, dtype=torch.float32),
                    "reward": [0.0] * n}
            await dock.put(cols, partition=part)
        return {"partitions": done}

    async def step(self, msg: dict[str, Any]) -> dict[str, Any]:
        put_rate, get_rate = float(msg["put_rate"]), float(msg["get_rate"])
        start_at, duration = float(msg["start_at"]), float(msg["duration"])
        lat: dict[str, list[float]] = {"put": [], "get": []}
        errors: dict[str, int] = {}
        got_samples = [0]
        in_flight = [0]
        dropped = {"put": 0, "get": 0}
        tasks: dict[asyncio.Task, tuple[str, float]] = {}
        loop = asyncio.get_running_loop()
        counter = {"put": 0, "get": 0}

        async def one(kind: str, scheduled: float) -> None:
            try:
                if kind == "put":
                    i = counter["put"]
                    counter["put"] += 1
                    dock, part = self.rollouts[i % len(self.rollouts)], self.parts[i % len(self.parts)]
                    await dock.put(self.payload, partition=part)
                else:
                    i = counter["get"]
                    counter["get"] += 1
                    dock, (consumer, part) = self.trainers[i % len(self.trainers)], self.pairs[i % len(self.pairs)]
                    batch = await dock.get(consumer, ["tokens", "logp", "reward"], self.rng.randint(1, 8),
                                           partition=part, allow_partial=True, timeout=30.0)
                    got_samples[0] += len(batch.indexes)
                lat[kind].append(time.monotonic() - scheduled)
            except Exception as e:  # noqa: BLE001 - counted and reported, the step goes on
                key = f"{kind}: {type(e).__name__}: {str(e)[:120]}"
                errors[key] = errors.get(key, 0) + 1
            finally:
                in_flight[0] -= 1

        def launch(kind: str, scheduled: float) -> None:
            if in_flight[0] >= MAX_IN_FLIGHT:
                dropped[kind] += 1
                return
            in_flight[0] += 1
            t = loop.create_task(one(kind, scheduled))
            tasks[t] = (kind, scheduled)
            t.add_done_callback(lambda t: tasks.pop(t, None))

        # every arrival of both kinds, in time order, at fixed intervals with a random phase
        arrivals: list[tuple[float, str]] = []
        for kind, rate in (("put", put_rate), ("get", get_rate)):
            if rate <= 0 or (kind == "put" and not self.rollouts) or (kind == "get" and not self.trainers):
                continue
            gap = 1.0 / rate
            t = start_at + self.rng.random() * gap
            while t < start_at + duration:
                arrivals.append((t, kind))
                t += gap
        arrivals.sort()
        now = time.monotonic()
        if start_at > now:
            await asyncio.sleep(start_at - now)
        behind_max = 0.0
        for when, kind in arrivals:
            delay = when - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                behind_max = max(behind_max, -delay)
            launch(kind, when)
        end = start_at + duration
        deadline = end + DRAIN_S
        while tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        late = len(tasks)
        stuck = list(tasks.items())
        for t, (kind, scheduled) in stuck:  # still unanswered: recorded with the time waited so far
            lat[kind].append(time.monotonic() - scheduled)
            t.cancel()
        if stuck:
            await asyncio.gather(*(t for t, _ in stuck), return_exceptions=True)
        return {
            "offered": {"put": sum(1 for _, k in arrivals if k == "put"), "get": sum(1 for _, k in arrivals if k == "get")},
            "latencies_s": lat,
            "errors": errors,
            "dropped": dropped,
            "late": late,
            "samples_got": got_samples[0],
            "scheduler_behind_max_s": behind_max,
            "finished_at": time.monotonic(),
        }

    async def close(self) -> None:
        for d in getattr(self, "docks", []):
            with contextlib.suppress(Exception):
                await d.close()


async def serve() -> None:
    worker = Worker()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout
    while True:
        line = await reader.readline()
        if not line:
            break
        msg = json.loads(line)
        cmd = msg.get("cmd")
        try:
            if cmd == "exit":
                await worker.close()
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                break
            fn = {"setup": worker.setup, "prefill": worker.prefill, "step": worker.step}[cmd]
            reply = {"ok": True, **(await fn(msg))}
        except Exception as e:  # noqa: BLE001 - the driver reports it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.controller_load.worker")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
