"""Every knob of one multinode run, validated in one place and recorded whole in the JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .netns import DEFAULT_PREFIX, DEFAULT_SUBNET, check_prefix

KiB = 1024

LAYOUTS = ("central", "distributed", "replicated", "ray")
"""central: one dockd warehouse on node 0 for every worker; distributed: one warehouse per node, each worker
writes to its own node's; replicated: distributed with ``dockd serve --replicas 2`` (each put is copied to the
next node's warehouse before it is answered); ray: one Ray actor buffer on node 0 (MindSpeed-RL TransferDock
style)."""


@dataclass(kw_only=True, slots=True)
class MultinodeConfig:
    quick: bool = False
    """Tiny sizes for tests and smoke runs; numbers from a quick run mean little."""
    nodes: tuple[int, ...] = (1, 2, 4, 8)
    """Cluster sizes to simulate, one network namespace per node."""
    layouts: tuple[str, ...] = LAYOUTS
    rate_mbit: float = 50.0
    """Every node's link cap, each direction (tbf), in Mbit/s."""
    link_burst_bytes: int = 0
    """tbf ``burst`` (0: 4 ms of the rate, at least 16 KiB)."""
    link_latency_ms: float = 20.0
    """tbf ``latency``: the longest a packet may wait in a link's queue (sets the queue length)."""
    node_sysctls: dict[str, str] = dataclasses.field(default_factory=dict)
    """``sysctl`` settings applied inside every node's namespace (e.g. TCP tuning), recorded with the run."""
    sample_bytes: int = 96 * KiB
    """Bytes one rollout sample writes: half ``responses`` (int32 tokens), half ``log_probs`` (float32)."""
    batch_per_node: int = 32
    """Samples each node's rollout worker writes per iteration; global batch = nodes x this."""
    consumer_workers: int = 2
    """Workers per consumer stage on every node (threads of the node's agent, each with its own connection and
    an equal share of the node's quota), like the data-parallel ranks of a trainer."""
    prefer_local: bool = True
    """distributed and replicated layouts: consumers take their own node's samples first (``Dock.get(prefer_local=True)``),
    then others; False: strict FIFO by index, so (N-1)/N of the reads cross links."""
    put_chunk: int = 8
    """Samples per rollout put."""
    get_chunk: int = 8
    """Samples per consumer get."""
    iterations: int = 4
    """Least measured iterations per layout and node count (the figures are medians over them)."""
    min_measure_s: float = 8.0
    """More iterations (up to ``max_iterations``) until the measured ones add up to this many seconds."""
    max_iterations: int = 10
    """Cap on the measured iterations that ``min_measure_s`` adds (never fewer than ``iterations``)."""
    warmup_iterations: int = 1
    """Iterations run first and not counted (connections, first page faults, Ray worker start)."""
    half_cap_nodes: int = 4
    """Node count at which every layout is measured again with the link cap halved (0: skip)."""
    half_cap_iterations: int = 2
    extrapolate_nodes: tuple[int, ...] = (64, 256)
    """Node counts for the analytic model and the in-process controller measurement."""
    prefix: str = DEFAULT_PREFIX
    """Namespace names start with this (plus a per-run tag); leftovers of dead runs with it are removed."""
    subnet: str = DEFAULT_SUBNET
    """First three octets of the nodes' /24 (node i is .i+1)."""
    daemon_capacity: str = "2GiB"
    """``dockd serve --capacity`` of every warehouse."""
    ray_max_concurrency: int = 16
    """Threads of the Ray buffer actor."""
    ray_object_store_bytes: int = 200 * 1000 * 1000
    """Object store of every Ray node (``ray start --object-store-memory``)."""
    command_timeout_s: float = 180.0
    """Longest wait for one agent command (an iteration, a setup); a stuck run fails after this."""
    start_timeout_s: float = 120.0
    """Longest wait for a daemon, agent or Ray node to start."""

    def __post_init__(self) -> None:
        if not self.nodes or any(int(n) < 1 or int(n) > 200 for n in self.nodes):
            raise ValueError(f"nodes must be counts in 1..200, got {self.nodes!r}")
        unknown = set(self.layouts) - set(LAYOUTS)
        if unknown or not self.layouts:
            raise ValueError(f"Unknown layout(s) {sorted(unknown)}. Valid layouts are: {list(LAYOUTS)}")
        if self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if self.sample_bytes < 128 or self.sample_bytes % 128:
            raise ValueError(f"sample_bytes must be a positive multiple of 128 (two 64-byte aligned columns), "
                             f"got {self.sample_bytes}")
        for name in ("batch_per_node", "put_chunk", "get_chunk", "iterations", "consumer_workers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_iterations < 0 or self.half_cap_nodes < 0 or self.half_cap_iterations < 1:
            raise ValueError("warmup_iterations and half_cap_nodes must be >= 0, half_cap_iterations >= 1")
        if self.min_measure_s < 0:
            raise ValueError(f"min_measure_s must be >= 0, got {self.min_measure_s}")
        check_prefix(self.prefix)
        if self.link_latency_ms <= 0:
            raise ValueError(f"link_latency_ms must be > 0, got {self.link_latency_ms}")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet must be three octets such as 10.88.0, got {self.subnet!r}")
        self.nodes = tuple(sorted({int(n) for n in self.nodes}))
        self.layouts = tuple(l for l in LAYOUTS if l in self.layouts)

    @classmethod
    def quick_config(cls, **overrides: Any) -> MultinodeConfig:
        """One and two nodes, a few small samples, dockd's two layouts (a Ray cluster alone takes longer to
        start than all of that; ask for it with ``layouts``): the whole run well under a minute."""
        values: dict[str, Any] = dict(
            quick=True, nodes=(1, 2), layouts=("central", "distributed"), sample_bytes=16 * KiB, batch_per_node=8,
            put_chunk=4, get_chunk=4, iterations=2, min_measure_s=0.0, warmup_iterations=1, half_cap_nodes=0,
            extrapolate_nodes=(64,), command_timeout_s=90.0,
        )
        values.update(overrides)
        return cls.from_dict(values)

    @property
    def column_bytes(self) -> dict[str, int]:
        return {"responses": self.sample_bytes // 2, "log_probs": self.sample_bytes // 2}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MultinodeConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"Unknown config field(s) {sorted(unknown)}. Valid fields are: {sorted(names)}")
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()})
