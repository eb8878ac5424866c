"""One simulated node's workers: ``ip netns exec NS python -m benchmarks.multinode.agent --node I``.

The runner starts one agent per node inside that node's network namespace
and drives it with one JSON object per line on stdin; the agent answers each
with one JSON line on the stdout it was started with (everything else the
process prints goes to stderr, the agent's log file). Commands:

    {"cmd": "setup", "backend": "dockd", "controller": "10.88.0.1:PORT", "warehouse": 0 | null}
    {"cmd": "setup", "backend": "ray", "head": "10.88.0.1:6379", "create_actor": bool, ...}
    {"cmd": "iter", "partition": P, "iteration": K, "start_at": MONOTONIC, "batch_per_node": ..., ...}
    {"cmd": "stats"}   {"cmd": "clear", "partition": P}   {"cmd": "teardown"}   {"cmd": "exit"}

An iteration runs the four GRPO stages of this node as threads (a rollout
writer and the reward, reference and trainer consumers, see ``workload``),
all starting at ``start_at`` on the system-wide monotonic clock, so the
runner can line up the nodes' reports. Each stage reports when it started
and finished, its payload bytes, and the keys of the samples it wrote or took.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

from .workload import CONSUMERS, check_values, key_node, make_chunk, sample_key, value_bytes

logger = logging.getLogger(__name__)


class Agent:
    """The commands of one node's agent; ``backend`` is the dockd or Ray client set up by ``setup``."""

    def __init__(self, node: int, node_ip: str) -> None:
        self.node = node
        self.node_ip = node_ip
        self.backend: Any = None

    def handlers(self) -> dict[str, Any]:
        return {"setup": self.setup, "iter": self.iteration, "stats": self.stats, "clear": self.clear,
                "teardown": self.teardown}

    # -- commands -------------------------------------------------------------------------
    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.teardown({})
        if msg["backend"] == "dockd":
            from .backends import DockdBackend

            workers = int(msg.get("consumer_workers", 1))
            slots = ["rollout"] + [worker_slot(c, w) for c in CONSUMERS for w in range(workers)]
            self.backend = DockdBackend(msg["controller"], warehouse=msg.get("warehouse"), node=self.node,
                                        slots=slots, prefer_local=bool(msg.get("prefer_local")))
        elif msg["backend"] == "ray":
            from .backends import RayBackend

            self.backend = RayBackend(msg["head"], node_ip=self.node_ip, create_actor=bool(msg.get("create_actor")),
                                      max_concurrency=int(msg.get("max_concurrency", 16)),
                                      timeout=float(msg.get("timeout", 60.0)))
        else:
            raise ValueError(f"unknown backend {msg['backend']!r}; valid: dockd, ray")
        return self.backend.describe()

    def iteration(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.backend is None:
            raise RuntimeError("iter before setup")
        part, it, start_at = msg["partition"], int(msg["iteration"]), float(msg["start_at"])
        quota, timeout = int(msg["batch_per_node"]), float(msg["timeout"])
        workers = int(msg.get("consumer_workers", 1))
        reports: dict[str, dict[str, Any]] = {}
        threads = [threading.Thread(target=self._guard, name=f"rollout-{self.node}", args=(
            reports, "rollout", self._rollout, part, it, start_at, quota, int(msg["put_chunk"]),
            int(msg["sample_bytes"])))]
        for name, cols in CONSUMERS.items():
            for w, share in enumerate(split_quota(quota, workers)):
                slot = worker_slot(name, w)
                threads.append(threading.Thread(target=self._guard, name=f"{slot}-{self.node}", args=(
                    reports, slot, self._consume, part, it, start_at, share, int(msg["get_chunk"]), name, slot,
                    cols, timeout)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = {k: r["error"] for k, r in reports.items() if "error" in r}
        if errors:
            raise RuntimeError(f"node {self.node} iteration {it}: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
        return {"stages": merge_workers(reports)}

    def stats(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self.backend.stats()

    def clear(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"samples": self.backend.clear(msg["partition"])}

    def teardown(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.backend is not None:
            backend, self.backend = self.backend, None
            backend.close()
        return {}

    # -- stages ---------------------------------------------------------------------------
    @staticmethod
    def _guard(reports: dict[str, Any], stage: str, fn: Any, *args: Any) -> None:
        try:
            reports[stage] = fn(*args)
        except BaseException as e:  # reported to the runner, which fails the run with it
            logger.error("[agent] stage %s failed: %s", stage, traceback.format_exc())
            reports[stage] = {"error": f"{type(e).__name__}: {e}"}

    def _rollout(self, part: str, it: int, start_at: float, quota: int, chunk: int, sample_bytes: int) -> dict:
        _sleep_until(start_at)
        t0 = time.monotonic()
        keys, nbytes, in_calls = [], 0, 0.0
        for seq0 in range(0, quota, chunk):
            n = min(chunk, quota - seq0)
            cols = make_chunk(self.node, it, seq0, n, sample_bytes)
            c0 = time.monotonic()
            self.backend.put("rollout", part, cols)
            in_calls += time.monotonic() - c0
            keys += [sample_key(self.node, seq0 + k) for k in range(n)]
            nbytes += sum(int(t.numel() * t.element_size()) for t in cols.values())
        return {"start": t0, "end": time.monotonic(), "bytes": nbytes, "keys": keys, "calls": -(-quota // chunk),
                "in_calls_s": in_calls}

    def _consume(self, part: str, it: int, start_at: float, quota: int, chunk: int, consumer: str, slot: str,
                 columns: tuple[str, ...], timeout: float) -> dict:
        from ..common import touch

        _sleep_until(start_at)
        t0 = time.monotonic()
        keys: list[int] = []
        nbytes, calls, waits, local, at = 0, 0, [], [], []
        while len(keys) < quota:
            c0 = time.monotonic()
            _, values = self.backend.get(slot, part, consumer, columns, min(chunk, quota - len(keys)), timeout)
            waits.append(round(time.monotonic() - c0, 4))
            at.append(round(c0 - start_at, 4))
            touch(values)  # zero-copy or lazily mapped results pay their page faults here
            got = check_values(values, it)
            local.append(sum(key_node(k) == self.node for k in got))
            keys += got
            nbytes += value_bytes(values)
            calls += 1
        return {"start": t0, "end": time.monotonic(), "bytes": nbytes, "keys": keys, "calls": calls,
                "in_calls_s": sum(waits), "call_s": waits, "call_at": at, "call_local": local}


def split_quota(quota: int, workers: int) -> list[int]:
    """``quota`` samples over ``workers`` (the first ones take the remainder); workers with nothing are dropped.
    The analytic model splits the same way (``model.Workload.shares``)."""
    base, extra = divmod(quota, max(1, workers))
    return [q for q in (base + (1 if w < extra else 0) for w in range(max(1, workers))) if q > 0]


def worker_slot(stage: str, worker: int) -> str:
    return stage if worker == 0 else f"{stage}#{worker}"


def merge_workers(reports: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One report per stage: the workers of a consumer stage summed (first start, last end)."""
    out: dict[str, dict[str, Any]] = {}
    for slot, r in reports.items():
        stage = slot.split("#", 1)[0]
        m = out.get(stage)
        if m is None:
            out[stage] = {**r, "workers": 1}
            continue
        m["start"], m["end"] = min(m["start"], r["start"]), max(m["end"], r["end"])
        for k in ("bytes", "calls", "in_calls_s"):
            m[k] = m.get(k, 0) + r.get(k, 0)
        m["keys"] = m["keys"] + r["keys"]
        m["call_s"] = m.get("call_s", []) + r.get("call_s", [])
        for k in ("call_at", "call_local"):
            m[k] = m.get(k, []) + r.get(k, [])
        m["workers"] += 1
    return out


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def serve(agent: Any, inp: Any, out: Any) -> None:
    """The line protocol: `agent.handlers()` by command name, `agent.teardown` on exit (any agent class)."""
    handlers = agent.handlers()
    out.write(json.dumps({"ok": True, "hello": agent.node, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in inp:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "exit":
            agent.teardown({})
            out.write(json.dumps({"ok": True}) + "\n")
            out.flush()
            return
        try:
            handler = handlers[cmd]
        except KeyError:
            reply = {"ok": False, "error": f"unknown command {cmd!r}; valid: {sorted(handlers)} and exit"}
        else:
            try:
                reply = {"ok": True, **handler(msg)}
            except Exception as e:
                logger.error("[agent] %s failed: %s", cmd, traceback.format_exc())
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    agent.teardown({})


def main(argv: list[str] | None = None, make: Any = None, prog: str = "python -m benchmarks.multinode.agent",
         description: str = __doc__.split("\n")[0]) -> int:
    """An agent process: `make(node, ip)` (default `Agent`) served on the original stdout."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--ip", required=True, help="this node's address")
    p.add_argument("--run-tag", default="", help="the run this agent belongs to (for ps and logs)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    # the protocol owns the original stdout; anything else printed (libraries, Ray) goes to the log
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format=f"%(asctime)s %(levelname)s node{args.node} %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    try:
        serve((make or Agent)(args.node, args.ip), sys.stdin, proto)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
