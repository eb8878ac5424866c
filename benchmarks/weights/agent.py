"""One simulated node's weights worker: ``ip netns exec NS python -m benchmarks.weights.agent --node I --ip IP``.

Driven by ``benchmarks.weights.relay`` over the line protocol of ``benchmarks.multinode.agent`` (one
JSON object per line in, one per line out). Commands:

    {"cmd": "connect", "controller": "10.88.0.1:PORT", "warehouse": W}
    {"cmd": "publish", "model": M, "mib": 256, "tensors": 64, "step": K, "changed": 0.02, "delta": bool,
     "bucket_mib": 4, "keep": 2, "hold": 30}
    {"cmd": "read", "model": M, "version": V, "relay": bool, "timeout": S}      (waits for it to be published)
    {"cmd": "broadcast", "master": "10.88.0.1:PORT", "rank": R, "world": N, "mib": 256, "tensors": 64}
    {"cmd": "teardown"}   {"cmd": "exit"}

Times are the system-wide monotonic clock (one kernel under every namespace), so the runner lines the
nodes up. A step's weights are made the same on every node (the base from a seed, then `changed` of
the values of every tensor moved per step), and every read answers with a checksum of what it got.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from benchmarks.multinode.agent import main as agent_main


def base_weights(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    per = (mib << 20) // tensors // 2  # bf16 values per tensor
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g).bfloat16() for i in range(tensors)}


def move(weights: dict[str, torch.Tensor], step: int, changed: float) -> None:
    """Step `step` of training as far as the bf16 bits go: `changed` of each tensor's values take new values."""
    g = torch.Generator().manual_seed(1000 + step)
    for t in weights.values():
        n = max(1, int(changed * t.numel()))
        pos = torch.randint(0, t.numel(), (n,), generator=g)
        t.view(-1)[pos] = torch.randn(n, generator=g).bfloat16()


def checksum(named: Any) -> int:
    return int(sum(int(t.view(torch.int16).to(torch.int64).sum()) for _, t in named)) & ((1 << 62) - 1)


class WeightsAgent:
    def __init__(self, node: int, ip: str) -> None:
        self.node, self.ip = node, ip
        self.dock: Any = None
        self.publishers: dict[str, Any] = {}
        self.readers: dict[str, Any] = {}
        self.weights: dict[str, torch.Tensor] | None = None

    def handlers(self) -> dict[str, Any]:
        return {"connect": self.connect, "publish": self.publish, "read": self.read, "broadcast": self.broadcast,
                "teardown": self.teardown}

    def connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        import dockd

        self.dock = dockd.connect(msg["controller"], warehouse=msg.get("warehouse"), connect_timeout=60)
        return {"home": self.dock.home}

    def _weights(self, msg: dict[str, Any]) -> dict[str, torch.Tensor]:
        if self.weights is None:
            self.weights = base_weights(int(msg["mib"]), int(msg["tensors"]))
        return self.weights

    def publish(self, msg: dict[str, Any]) -> dict[str, Any]:
        from dockd.weights import Publisher

        w = self._weights(msg)
        if msg.get("step"):
            move(w, int(msg["step"]), float(msg["changed"]))
        model = msg["model"]
        pub = self.publishers.get(model)
        if pub is None:
            pub = self.publishers[model] = Publisher(self.dock, model, delta=bool(msg.get("delta")),
                                                     bucket_size=int(msg["bucket_mib"]) << 20,
                                                     keep=int(msg.get("keep", 2)), hold=float(msg.get("hold", 30)))
        changed = None
        if pub.last is not None:  # (a delta: how many bf16 values changed, against the version before)
            from dockd.weights.delta import changed as positions

            changed = sum(int(positions(t, pub.last[1][name]).numel()) for name, t in w.items())
        t0 = time.monotonic()
        p = pub.publish(w.items())
        return {"start": t0, "end": time.monotonic(), "version": p.version, "stored": p.stored, "nbytes": p.nbytes,
                "base": p.base, "buckets": p.buckets, "checksum": checksum(w.items()), "changed": changed}

    def read(self, msg: dict[str, Any]) -> dict[str, Any]:
        from dockd.weights import WeightsReader

        model = msg["model"]
        r = self.readers.get(model)
        if r is None:
            r = self.readers[model] = WeightsReader(self.dock, model, relay=bool(msg.get("relay", True)))
        t0 = time.monotonic()
        reading = r.open(int(msg["version"]), timeout=float(msg.get("timeout", 600)))
        opened = time.monotonic()
        first = None
        total = 0
        for _, t in reading.tensors():
            if first is None:
                first = time.monotonic()
            total += int(t.view(torch.int16).to(torch.int64).sum())
        end = time.monotonic()
        depth = reading.source().depth if r.relay else 0
        return {"start": t0, "opened": opened, "first": first, "end": end, "version": reading.version,
                "bytes": reading.bytes, "depth": depth, "checksum": total & ((1 << 62) - 1)}

    def broadcast(self, msg: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        rank, world = int(msg["rank"]), int(msg["world"])
        dist.init_process_group("gloo", init_method=f"tcp://{msg['master']}", rank=rank, world_size=world)
        try:
            if rank == 0:
                tensors = list(self._weights(msg).values())
            else:
                per = (int(msg["mib"]) << 20) // int(msg["tensors"]) // 2
                tensors = [torch.empty(per, dtype=torch.bfloat16) for _ in range(int(msg["tensors"]))]
            dist.barrier()
            t0 = time.monotonic()
            for t in tensors:  # (one broadcast per tensor, as verl's naive sync does)
                dist.broadcast(t, src=0)
            end = time.monotonic()
            return {"start": t0, "end": end, "checksum": checksum((None, t) for t in tensors)}
        finally:
            dist.destroy_process_group()

    def teardown(self, msg: dict[str, Any]) -> dict[str, Any]:
        for r in self.readers.values():
            r.close()
        self.readers.clear()
        if self.dock is not None:
            self.dock.close()
            self.dock = None
        return {}


if __name__ == "__main__":
    sys.exit(agent_main(make=WeightsAgent, prog="python -m benchmarks.weights.agent",
                        description="one simulated node's weights worker"))
