"""Weights from one trainer node to N rollout nodes in the simulated cluster (network namespaces, every
link capped both ways with tbf): dockd's relay, every reader pulling from the trainer, and a
`torch.distributed` broadcast (gloo), in the same run, and dockd's relay of delta versions.

    sudo .venv/bin/python -m benchmarks.weights --nodes 1,2,4,8 --rate-mbit 200 --mib 256 \\
        --out bench-results/weights_relay.json

Node 0 runs the controller, a warehouse and the trainer (it publishes); nodes 1..N a warehouse and a
reader each. Per N and method, one update: the time from the publish's start to the last reader's
end (the broadcast: from its common start to its end), the bytes on the trainer's link (node 0's
switch-port counters) and the checksums every reader got. `relay`: readers read through their own
warehouse (`WeightsReader(relay=True)`, a chain); `direct`: every reader reads every bucket from the
trainer's warehouse (`relay=False`); `gloo`: one broadcast per tensor from rank 0 (`dist.broadcast`);
`delta`: the next version as a delta (`--changed` of the values moved) through the relay. With
`--half-cap` the relay at N = 1 runs again with the links at half the rate: twice the time says
the links, not the two cores, set the pace. Needs root (namespaces); removes what it creates.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.multinode.cluster import Agents, DockdNodes, dock_token
from benchmarks.multinode.netns import Topology, cleanup_leftovers, missing_privileges, new_tag

logger = logging.getLogger(__name__)

PREFIX = "dkwt"
MODULE = "benchmarks.weights.agent"


def _say(msg: str) -> None:
    print(f"[weights] {msg}", file=sys.stderr, flush=True)


class Run:
    """The simulated cluster of one run: topology, daemons, agents; and a version counter per model."""

    def __init__(self, topo: Topology, daemons: DockdNodes, agents: Agents, args: argparse.Namespace) -> None:
        self.topo, self.daemons, self.agents, self.args = topo, daemons, agents, args
        self.versions: dict[str, int] = {}
        self.step = 0

    def _tx0(self) -> int:
        return self.topo.counters()[0]["tx_bytes"]

    def update(self, method: str, n: int) -> dict[str, Any]:
        """One update of the model to rollout nodes 1..n by `method`; its figures. A delta update first
        brings every reader to the version it is built on (unmeasured)."""
        if method == "gloo":
            return self._broadcast(n)
        if method == "delta":
            self._round("delta", n, relay=True, delta=True)
        return self._round(method, n, relay=method != "direct", delta=method == "delta")

    def _round(self, model: str, n: int, *, relay: bool, delta: bool) -> dict[str, Any]:
        a = self.args
        version = self.versions[model] = self.versions.get(model, -1) + 1
        if delta:
            self.step += 1
        tx = self._tx0()
        readers = range(1, n + 1)
        for i in readers:
            self.agents[i].send({"cmd": "read", "model": model, "version": version, "relay": relay,
                                 "timeout": a.timeout})
        time.sleep(0.2)  # (the readers wait for the version before it is published)
        pub = self.agents[0].call({"cmd": "publish", "model": model, "mib": a.mib, "tensors": a.tensors,
                                   "bucket_mib": a.bucket_mib, "delta": delta, "step": self.step if delta else 0,
                                   "changed": a.changed, "keep": 2, "hold": 30}, a.timeout)
        reps = [self.agents[i].receive(a.timeout, "read") for i in readers]
        self._check(model, n, {pub["checksum"]} | {r["checksum"] for r in reps})
        return {"method": model, "nodes": n, "seconds": max(r["end"] for r in reps) - pub["start"],
                "trainer_tx": self._tx0() - tx, "model_bytes": a.mib << 20, "rate_mbit": self.topo.rate_mbit,
                "publish_s": pub["end"] - pub["start"], "stored": pub["stored"], "base": pub["base"],
                "changed": pub["changed"], "floor": None if pub["changed"] is None else pub["changed"] * (2 + 4),
                "read_s": [r["end"] - r["start"] for r in reps], "depth": [r["depth"] for r in reps]}

    def _broadcast(self, n: int) -> dict[str, Any]:
        a = self.args
        tx = self._tx0()
        master = f"{self.topo.nodes[0].ip}:{29500 + secrets.randbelow(1000)}"
        msg = {"cmd": "broadcast", "master": master, "world": n + 1, "mib": a.mib, "tensors": a.tensors}
        for i in range(n + 1):
            self.agents[i].send({**msg, "rank": i})
        reps = [self.agents[i].receive(a.timeout, "broadcast") for i in range(n + 1)]
        self._check("gloo", n, {r["checksum"] for r in reps})
        return {"method": "gloo", "nodes": n, "seconds": max(r["end"] for r in reps) - min(r["start"] for r in reps),
                "trainer_tx": self._tx0() - tx, "model_bytes": a.mib << 20, "rate_mbit": self.topo.rate_mbit}

    @staticmethod
    def _check(method: str, n: int, sums: set[int]) -> None:
        if len(sums) != 1:
            raise RuntimeError(f"{method} at N={n}: the nodes got different weights (checksums {sums})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    ns = sorted(int(x) for x in args.nodes.split(","))
    cleanup_leftovers(PREFIX)
    tag = new_tag(PREFIX)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "config": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="dockd-weights-") as tmp, \
            Topology(ns[-1] + 1, args.rate_mbit, tag=tag) as topo:
        workdir = Path(tmp)
        auth = dock_token(workdir)
        daemons = DockdNodes(topo, ns[-1] + 1, workdir, capacity=args.capacity, timeout=120, env_extra=auth)
        try:
            agents = Agents(topo.nodes, workdir, tag, timeout=120, env_extra=auth, module=MODULE)
            try:
                wids = daemons.warehouse_ids()
                agents.broadcast([{"cmd": "connect", "controller": daemons.controller, "warehouse": w}
                                  for w in wids], 120)
                r = Run(topo, daemons, agents, args)
                for n in ns:
                    for method in args.methods.split(","):
                        res = r.update(method, n)
                        out["runs"].append(res)
                        _say(f"N={n} {method}: {res['seconds']:.2f}s, trainer link {res['trainer_tx'] / 2**20:.1f} "
                             f"MiB ({res['trainer_tx'] / res['model_bytes']:.2f}x the model)"
                             + (f", stored {res['stored'] / 2**20:.1f} MiB" if "stored" in res else "")
                             + (f" = {res['stored'] / res['floor']:.3f}x the changed values + their int32 index"
                                if res.get("floor") and res.get("base") is not None else ""))
                if args.half_cap:
                    for rate in (args.rate_mbit / 2, args.rate_mbit):
                        topo.set_rate(rate)
                        res = r.update("relay", ns[0])
                        out["runs"].append({**res, "half_cap_check": True})
                        _say(f"N={ns[0]} relay at {rate:g} Mbit/s: {res['seconds']:.2f}s")
                agents.broadcast({"cmd": "teardown"}, 60)
            finally:
                agents.close()
        finally:
            daemons.close()
    return out


def summary(result: dict[str, Any]) -> str:
    rows = [r for r in result["runs"] if not r.get("half_cap_check")]
    lines = ["| method | N | update s | trainer link / model | stored MiB | stored / (changed values + index) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        stored = f"{r['stored'] / 2**20:.1f}" if "stored" in r else "-"
        floor = f"{r['stored'] / r['floor']:.3f}" if r.get("floor") and r.get("base") is not None else "-"
        lines.append(f"| {r['method']} | {r['nodes']} | {r['seconds']:.2f} | {r['trainer_tx'] / r['model_bytes']:.3f} "
                     f"| {stored} | {floor} |")
    half = [r for r in result["runs"] if r.get("half_cap_check")]
    if len(half) == 2:
        lines.append(f"\nrelay at N={half[0]['nodes']}: {half[0]['seconds']:.2f}s at {half[0]['rate_mbit']:g} Mbit/s, "
                     f"{half[1]['seconds']:.2f}s at {half[1]['rate_mbit']:g} Mbit/s "
                     f"(ratio {half[0]['seconds'] / half[1]['seconds']:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weights", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,2,4,8", help="rollout node counts (the trainer's node comes on top)")
    ap.add_argument("--methods", default="relay,direct,gloo,delta")
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--mib", type=int, default=256, help="model size (bf16)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--bucket-mib", type=int, default=4)
    ap.add_argument("--changed", type=float, default=0.02, help="share of values a delta step moves")
    ap.add_argument("--capacity", default="3GiB", help="each warehouse's --capacity")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--half-cap", action="store_true", help="also the relay at N = min(nodes) at half the rate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    why = missing_privileges(PREFIX)
    if why is not None:
        print(f"benchmarks.weights: {why}", file=sys.stderr)
        return 2
    result = run(args)
    print(summary(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
