"""Analytic model: bytes per warehouse and per link for one iteration, central vs distributed.

Pure functions, no I/O. Assumptions (the benchmark's workload, see ``workload``):

- N nodes, each with one writer (rollout) that creates ``b`` samples per
  iteration, and one process per consumer stage; same-named consumers share
  a stream, so each takes ``b`` samples, drawn from the whole cluster (dockd
  hands out the oldest ready samples, whichever warehouse holds them).
- A sample's columns are written once (``W`` bytes) and read once per
  consumer stage (``R`` bytes in total over the stages).
- Traffic between a process and a warehouse on the same node stays off the
  links (shared memory); everything else crosses the writer's or reader's
  link and the holder's link. Links are full duplex, capped at ``C`` bytes/s
  each way, and the bridge is not a bottleneck.

central (one buffer on node 0; also the Ray-actor layout)::

    node 0 receives (N-1)·b·W, sends (N-1)·b·R; every other node sends b·W, receives b·R
    the one warehouse stores N·b·W and serves N·b·R

distributed (one warehouse per node, each writer writes to its own)::

    every node sends and receives b·R·(N-1)/N (a reader finds 1/N of its samples at home)
    every warehouse stores b·W and serves b·R

The busiest link bounds the iteration from below: ``T >= max bytes / C``, so
central throughput stays at about C / max(W, R) samples/s whatever N,
and distributed throughput grows as N²/(N-1) · C/R ~ N · C/R. Protocol
headers (TCP/IP framing, about 3 % at a 1500-byte MTU) and metadata messages
are not in the model; the measured link counters include them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CENTRAL_LIKE = ("central", "ray")
LAYOUTS = ("central", "distributed", "ray")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one iteration moves, per node."""

    batch_per_node: int
    column_bytes: Mapping[str, int]
    """Payload bytes per sample of every column the writer creates."""
    consumers: Mapping[str, Sequence[str]]
    """Consumer stage -> the columns it reads."""
    put_chunk: int = 8
    get_chunk: int = 8
    workers: int = 1
    """Processes per consumer stage on every node; each takes an equal share of the node's samples."""

    def __post_init__(self) -> None:
        if min(self.batch_per_node, self.put_chunk, self.get_chunk, self.workers) < 1:
            raise ValueError("batch_per_node, put_chunk, get_chunk and workers must be >= 1")
        for name, cols in self.consumers.items():
            unknown = set(cols) - set(self.column_bytes)
            if unknown:
                raise ValueError(f"consumer {name!r} reads unknown column(s) {sorted(unknown)}")

    def shares(self) -> list[int]:
        """Samples per consumer process of one stage on one node (the first ones take the remainder)."""
        base, extra = divmod(self.batch_per_node, self.workers)
        return [q for q in (base + (1 if w < extra else 0) for w in range(self.workers)) if q > 0]

    @property
    def written_bytes(self) -> int:
        """W: bytes written per sample."""
        return int(sum(self.column_bytes.values()))

    @property
    def read_bytes(self) -> int:
        """R: bytes read per sample, summed over the consumer stages."""
        return int(sum(self.column_bytes[c] for cols in self.consumers.values() for c in cols))


def traffic(layout: str, nodes: int, wl: Workload, *, link_bytes_per_s: float | None = None) -> dict[str, Any]:
    """Bytes per warehouse and per link in one iteration; with a link rate, the link-bound iteration time."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}. Valid layouts are: {list(LAYOUTS)}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    n, b, w, r = nodes, wl.batch_per_node, wl.written_bytes, wl.read_bytes
    samples = n * b
    if layout in CENTRAL_LIKE:
        node0 = {"rx": (n - 1) * b * w, "tx": (n - 1) * b * r}
        other = {"rx": b * r, "tx": b * w} if n > 1 else None
        warehouses = 1
        stored, served, served_remote = samples * w, samples * r, (n - 1) * b * r
    else:
        x = b * r * (n - 1) / n
        node0 = {"rx": x, "tx": x}
        other = {"rx": x, "tx": x} if n > 1 else None
        warehouses = n
        stored, served, served_remote = b * w, b * r, x
    links = [node0] + ([other] if other else [])
    busiest = max(max(d.values()) for d in links)
    total_link = node0["rx"] + node0["tx"] + (n - 1) * ((other or {}).get("rx", 0) + (other or {}).get("tx", 0))
    puts = n * math.ceil(b / wl.put_chunk)
    acquires = n * len(wl.consumers) * sum(math.ceil(q / wl.get_chunk) for q in wl.shares())
    out: dict[str, Any] = {
        "layout": layout,
        "nodes": n,
        "samples": samples,
        "written_bytes_per_sample": w,
        "read_bytes_per_sample": r,
        "warehouses": warehouses,
        "per_warehouse_stored_bytes": float(stored),
        "per_warehouse_served_bytes": float(served),
        "per_warehouse_served_remote_bytes": float(served_remote),
        "node0_link": {k: float(v) for k, v in node0.items()},
        "other_link": {k: float(v) for k, v in other.items()} if other else None,
        "busiest_link_bytes": float(busiest),
        "all_links_bytes": float(total_link),
        "puts": puts,
        "acquires": acquires,
        "link_bytes_per_s": link_bytes_per_s,
        "iteration_s": None,
        "samples_per_s": None,
    }
    if link_bytes_per_s:
        t = busiest / link_bytes_per_s
        out["iteration_s"] = t
        out["samples_per_s"] = samples / t if t > 0 else math.inf
    return out


def speedup(nodes: int, wl: Workload) -> float:
    """Link-bound distributed over central throughput at the same N (inf at N=1, where no link is used)."""
    c = traffic("central", nodes, wl, link_bytes_per_s=1.0)
    d = traffic("distributed", nodes, wl, link_bytes_per_s=1.0)
    if not d["iteration_s"]:
        return math.inf
    return c["iteration_s"] / d["iteration_s"]


def extrapolate(node_counts: Iterable[int], wl: Workload, link_bytes_per_s: float) -> list[dict[str, Any]]:
    """The model for central and distributed at each node count, with the controller's request load."""
    rows = []
    for n in node_counts:
        for layout in ("central", "distributed"):
            t = traffic(layout, n, wl, link_bytes_per_s=link_bytes_per_s)
            requests = t["puts"] + t["acquires"]
            t["controller_requests"] = requests
            t["controller_requests_per_s"] = requests / t["iteration_s"] if t["iteration_s"] else None
            t["vs_central"] = speedup(n, wl) if layout == "distributed" else 1.0
            rows.append(t)
    return rows


def controller_budget(requests: int, controller_s: float, iteration_s: float | None) -> dict[str, Any]:
    """Compare what one controller sustains with what the links let N nodes ask of it.

    ``controller_s``: controller CPU seconds for one iteration's requests (measured); ``iteration_s``: the
    link-bound iteration time at that N. Utilisation above 1 means the controller, not the links, binds."""
    sustained = requests / controller_s if controller_s > 0 else math.inf
    needed = requests / iteration_s if iteration_s else None
    return {
        "requests_per_iteration": requests,
        "controller_s_per_iteration": controller_s,
        "sustained_requests_per_s": sustained,
        "needed_requests_per_s": needed,
        "utilisation": (controller_s / iteration_s) if iteration_s else None,
    }
