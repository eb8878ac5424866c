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

replicated (distributed, and each put copied to the next node's warehouse before it is answered)::

    as distributed, plus b·W more sent and received by every node (N > 1)
    every warehouse stores 2·b·W and serves b·R (readers read the home copy)

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
LAYOUTS = ("central", "distributed", "replicated", "ray")


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
        copies = b * w if layout == "replicated" and n > 1 else 0  # (to the next node, from the previous one)
        x = b * r * (n - 1) / n
        node0 = {"rx": x + copies, "tx": x + copies}
        other = {"rx": x + copies, "tx": x + copies} if n > 1 else None
        warehouses = n
        stored, served, served_remote = b * w + copies, b * r, x
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


# ------------------------------------------------------------------ streaming (asynchronous RL) at scale

STREAMING_CPU_S_PER_REQUEST = 636e-6
"""Controller daemon CPU seconds per client request used when no load-benchmark figure is given: the mean of
the node-0 daemon's CPU per request in the distributed runs of ``multinode_2core-vm_2026-12-01_dockd.md``
(562, 688, 703 and 592 us at 1, 2, 4 and 8 nodes; that daemon also hosted a warehouse)."""

STREAMING_NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STREAMING_CONTROLLERS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Streaming:
    """A streaming workload: every accelerator's rollout produces trajectories at a steady rate, each put
    once and taken once (asynchronous RL: no iterations, a request stream)."""

    accelerators_per_node: int = 8
    trajectories_per_s: float = 10.0
    """Per accelerator."""
    puts_per_trajectory: float = 1.0
    gets_per_trajectory: float = 1.0

    def __post_init__(self) -> None:
        if self.accelerators_per_node < 1 or self.trajectories_per_s <= 0:
            raise ValueError("accelerators_per_node must be >= 1 and trajectories_per_s > 0")
        if self.puts_per_trajectory < 0 or self.gets_per_trajectory < 0 or \
                self.puts_per_trajectory + self.gets_per_trajectory <= 0:
            raise ValueError("puts_per_trajectory and gets_per_trajectory must be >= 0, not both 0")

    @property
    def requests_per_node_per_s(self) -> float:
        return self.accelerators_per_node * self.trajectories_per_s * (
            self.puts_per_trajectory + self.gets_per_trajectory)

    def requests_per_s(self, nodes: int) -> float:
        return nodes * self.requests_per_node_per_s


def busiest_share(controllers: int, partitions: int | None = None) -> float:
    """The busiest controller's share of the requests: 1/K when the partitions spread evenly (``partitions``
    None, or a multiple of K), else ceil(P/K)/P (equal traffic per partition, whole partitions per controller)."""
    if controllers < 1:
        raise ValueError(f"controllers must be >= 1, got {controllers}")
    if partitions is None:
        return 1.0 / controllers
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return math.ceil(partitions / controllers) / partitions


def streaming_load(nodes: int, st: Streaming, cpu_s_per_request: float, *, controllers: int = 1,
                   partitions: int | None = None) -> dict[str, Any]:
    """The request rate N nodes ask of K controllers, and the busiest controller's utilisation (CPU seconds
    per second: 1 means one core fully busy with controller work, so >= 1 is where the controller binds)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if cpu_s_per_request <= 0:
        raise ValueError(f"cpu_s_per_request must be > 0, got {cpu_s_per_request}")
    total = st.requests_per_s(nodes)
    busiest = total * busiest_share(controllers, partitions)
    util = busiest * cpu_s_per_request
    return {
        "nodes": nodes,
        "accelerators": nodes * st.accelerators_per_node,
        "controllers": controllers,
        "requests_per_s": total,
        "busiest_controller_requests_per_s": busiest,
        "one_controller_sustains_requests_per_s": 1.0 / cpu_s_per_request,
        "utilisation": util,
        "binds": util >= 1.0,
    }


def streaming_binding_nodes(st: Streaming, cpu_s_per_request: float, *, controllers: int = 1,
                            partitions: int | None = None) -> float:
    """The node count at which the busiest of K controllers reaches utilisation 1 (a real number; the first
    whole node count that binds is its ceiling)."""
    per_node = st.requests_per_node_per_s * busiest_share(controllers, partitions) * cpu_s_per_request
    return 1.0 / per_node


def controllers_needed(nodes: int, st: Streaming, cpu_s_per_request: float) -> int:
    """The fewest evenly loaded controllers that keep every one below utilisation 1 at N nodes."""
    return math.floor(st.requests_per_s(nodes) * cpu_s_per_request) + 1


def streaming_table(st: Streaming, cpu_s_per_request: float, *, nodes: Iterable[int] = STREAMING_NODES,
                    controllers: Iterable[int] = STREAMING_CONTROLLERS,
                    partitions: int | None = None) -> dict[str, Any]:
    """Utilisation per node count and controller count, where each K binds, and how many controllers the
    largest node count needs."""
    nodes, controllers = list(nodes), list(controllers)
    rows = []
    for n in nodes:
        per_k = {k: streaming_load(n, st, cpu_s_per_request, controllers=k, partitions=partitions) for k in controllers}
        rows.append({"nodes": n, "accelerators": n * st.accelerators_per_node,
                     "requests_per_s": st.requests_per_s(n),
                     "utilisation": {str(k): per_k[k]["utilisation"] for k in controllers}})
    binds = {}
    for k in controllers:
        x = streaming_binding_nodes(st, cpu_s_per_request, controllers=k, partitions=partitions)
        binds[str(k)] = {"nodes_exact": x, "first_node_count": math.ceil(x - 1e-9),
                         "first_listed": next((n for n in nodes if n >= x - 1e-9), None)}
    top = max(nodes)
    return {
        "workload": dataclasses.asdict(st),
        "cpu_s_per_request": cpu_s_per_request,
        "partitions": partitions,
        "rows": rows,
        "binds_at": binds,
        "largest_nodes": top,
        "controllers_needed_at_largest": controllers_needed(top, st, cpu_s_per_request),
    }
