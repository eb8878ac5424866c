"""`Dock.stats`: the controller's stats reply as a dict, and each warehouse's traffic on request."""

from __future__ import annotations

from typing import Any

from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.client.router import Router
from dockd.errors import DockError

STATS_HELLO_TIMEOUT_S = 2.0
"""Seconds stats(traffic=True) waits for each warehouse's answer (one that does not answer gets an error)."""


def _pending_by(p: pb.PartitionStats) -> dict[str, int]:
    """With max_pending: per consumer that puts wait for (those named by retire_when_consumed_by, else
    every consumer that asked), the samples not yet handed to it, the most first. A named consumer that
    never asked holds back every pending sample."""
    if not p.max_pending:
        return {}
    depth = {c.name: c.pending for c in p.consumers}
    names = list(p.retire_when_consumed_by) or list(depth)
    return dict(sorted(((n, depth.get(n, p.pending)) for n in names), key=lambda kv: (-kv[1], kv[0])))


def _partition(p: pb.PartitionStats) -> dict[str, Any]:
    return {
        "samples": p.samples,
        "group_size": p.group_size,
        "columns": dict(zip(p.columns, p.column_ready)),
        "consumers": {c.name: {"taken": c.taken, "leased": c.leased, "ready": c.ready, "waiting": c.waiting}
                      for c in p.consumers},
        "depth": {c.name: c.pending for c in p.consumers},
        "recovered": p.recovered,
        "deleted": p.deleted,
        "sealed": p.sealed,
        "retire_when_consumed_by": list(p.retire_when_consumed_by),
        "tags": list(p.tags),
        "version": p.version,
        "max_staleness": p.max_staleness - 1 if p.max_staleness else None,
        "retire_stale": p.retire_stale,
        "max_pending": p.max_pending or None,
        "pending": p.pending,
        "stale": p.stale,
        "stale_retired": p.stale_retired,
        "paced_puts": p.paced,
        "pending_by": _pending_by(p),
        "replicated": p.replicated,
        "under_replicated": p.under_replicated,
    }


_SUMMED = ("samples", "deleted", "pending", "stale", "stale_retired", "paced_puts", "replicated",
           "under_replicated", "max_pending")
"""A spread partition's numbers that are its shards' summed (max_pending: each shard's is a share of it)."""


def _summed(entries: list[dict[str, int]]) -> dict[str, int]:
    """Per key (consumer, column), the entries' values summed."""
    out: dict[str, int] = {}
    for entry in entries:
        for key, n in entry.items():
            out[key] = out.get(key, 0) + n
    return out


def _spread(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """A spread partition's entry from its shards' (those that exist): numbers summed, consumers and
    columns merged (their counts summed), sealed when every shard is, recovered when any is, the
    trainer's version the newest; its options are the first shard's (create_partition sets them on all).
    A consumer's depth on a shard it never asked is that shard's samples not deleted (reserved ones
    not yet written included)."""
    first = shards[0]
    consumers: dict[str, dict[str, int]] = {}
    for shard in shards:
        for name, c in shard["consumers"].items():
            consumers[name] = _summed([consumers.get(name, {}), c])
    out = {**first, **{key: sum(shard[key] or 0 for shard in shards) for key in _SUMMED},
           "columns": _summed([shard["columns"] for shard in shards]),
           "consumers": consumers,
           "depth": {name: sum(shard["depth"].get(name, shard["samples"] - shard["deleted"]) for shard in shards)
                     for name in consumers},
           "pending_by": dict(sorted(_summed([shard["pending_by"] for shard in shards]).items(),
                                     key=lambda kv: (-kv[1], kv[0]))),
           "sealed": all(shard["sealed"] for shard in shards),
           "recovered": any(shard["recovered"] for shard in shards),
           "tags": list(dict.fromkeys(t for shard in shards for t in shard["tags"])),
           "version": max(shard["version"] for shard in shards),
           "controller": [shard["controller"] for shard in shards]}
    out["max_pending"] = out["max_pending"] or None
    return out


def stats(replies: dict[str, pb.StatsReply], router: Router, *, traffic: bool,
          connect_timeout: float) -> dict[str, Any]:
    """The dict Dock.stats returns, from each controller's reply (by its address): each partition
    from the controller that owns it (named in its "controller"), the warehouses as the first
    controller sees them (every controller knows each warehouse; it numbers them), gets waiting
    summed over the controllers.

    A spread partition (--shards) is listed under its own name, summed over its shards ("shards":
    their names; "controller": the list of their controllers), and each shard under its own name as
    an ordinary partition; the top-level "samples" counts each sample once."""
    first = next(iter(replies.values()))
    parts = {}
    for address, s in replies.items():
        for p in s.partitions:
            parts[p.name] = {**_partition(p), "controller": address}
    samples = sum(p["samples"] for p in parts.values())
    for name, count in router.shards.items():
        names = [owners.shard_name(name, k, count) for k in range(count)]
        there = [parts[n] for n in names if n in parts]
        if there:
            parts[name] = {**_spread(there), "shards": names}
    whs = {
        w.id: {"address": f"{w.host}:{w.port}", "alive": w.alive, "state": w.state or "joined",
               "capacity": w.capacity, "bytes": w.used}
        for w in first.warehouses
    }
    if len(replies) > 1:  # bytes a warehouse holds: each controller counts its own partitions'
        for s in list(replies.values())[1:]:
            for w in s.warehouses:
                if w.id in whs:
                    whs[w.id]["bytes"] += w.used
    if traffic:
        router.learn(first.warehouses)
        for wid, w in whs.items():
            if not w["alive"]:
                continue
            try:
                hello = router.hello(wid, timeout=min(connect_timeout, STATS_HELLO_TIMEOUT_S))
            except DockError as e:
                w["error"] = str(e)
                continue
            w.update(version=hello.version, put_bytes=hello.put_bytes, get_bytes=hello.get_bytes,
                     device_bytes=hello.device_used, device_capacity=hello.device_capacity,
                     metadata_bytes=hello.metadata, freed_bytes=hello.freed, reclaimable_bytes=hello.reclaimable,
                     spilled_bytes=hello.spilled)
            if hello.transport:  # how it serves remote readers: "socket" or "mooncake"
                w["serves"] = hello.transport
    for wid, w in whs.items():  # how this client reads from each warehouse it has a pool for
        pool = router.pools.get(wid)
        if pool is not None:
            w["transport"] = getattr(pool.via, "effective", pool.transport)
            note = getattr(pool.via, "declined", "")
            if note:
                w["transport_note"] = note
    return {
        "version": first.version,
        "controller": router.address,
        "transport": router.ctx.config.transport,
        "controllers": list(replies),
        "samples": samples,
        "bytes": sum(w["bytes"] for w in whs.values()),
        "waiting": sum(s.waiting for s in replies.values()),
        "partitions": parts,
        "warehouses": whs,
    }
