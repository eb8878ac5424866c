"""Puts: a put's arguments checked and encoded, then sent to the home warehouse.

The encoding is done once; the home warehouse's transport decides how the
payload travels (in the frame, staged in shared memory, device memory by
handle), and the router re-homes and re-sends it when the warehouse goes
away (the put's token makes a re-sent put apply once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dockd import codec, ids
from dockd._proto import dockd_pb2 as pb
from dockd.client import tensordicts, validate
from dockd.client.router import Router
from dockd.errors import DockConnectionError, DockTimeout, DockTypeError, DockValueError
from dockd.net import device_share
from dockd.net.pool import Pool
from dockd.net.transport import ANSWER_GRACE_S, Put

logger = logging.getLogger(__name__)

PUT_SLACK_S = 10.0


def split_columns(columns: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """Each column as one batched tensor, a jagged column or a sequence of values, and the number of
    samples. `columns` may be a tensordict.TensorDict of batch_size [n]."""
    if tensordicts.is_tensordict(columns):
        columns = tensordicts.columns_of(columns)
    if not isinstance(columns, Mapping) or not columns:
        raise DockTypeError("columns must be a non-empty dict of column name -> values")
    split: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for name, values in columns.items():
        if not isinstance(name, str) or not name:
            raise DockTypeError(f"column names must be non-empty strings, got {name!r}")
        validate.text(name, "column name")
        if (j := codec.jagged(name, values)) is not None:  # a jagged column: one buffer
            split[name], counts[name] = j, j.offsets.numel() - 1
            continue
        t = codec.batched(values)  # kept whole: encoded as one buffer too
        split[name] = t if t is not None else codec.split_column(name, values)
        counts[name] = int(t.shape[0]) if t is not None else len(split[name])
    n = next(iter(counts.values()))
    if n == 0 or len(set(counts.values())) != 1:
        raise DockValueError(f"every column needs the same positive number of values, got {counts}")
    return split, n


def put_request(columns: Mapping[str, Any], *, partition: str, indexes: Sequence[int] | None, group_size: int,
                timeout: float | None, tags: Mapping[str, Any] | None, device: str | None,
                version: int | None) -> tuple[Put, list]:
    """The encoded put (see Dock.put), and the device tensors it exports by handle (to keep
    referenced until the put is answered: the warehouse copies out of them)."""
    validate.check_partition(partition)
    split, n = split_columns(columns)
    timeout = validate.seconds(timeout)
    req = pb.PutRequest(partition=partition, timeout=-1.0 if timeout is None else timeout)
    if indexes is None:
        validate.positive_count("group_size", group_size)
        if n % group_size:
            raise DockValueError(f"{n} new samples is not a multiple of group_size={group_size}")
        req.new_count, req.group_size = n, group_size
    else:
        idx = validate.int_list("indexes", indexes)
        if len(idx) != n:
            raise DockValueError(f"{len(idx)} indexes given for {n} values per column")
        req.indexes.extend(idx)
    tags = validate.version_tag(version, tags)
    if tags:
        req.tags.extend(validate.tag_list(tags, n))
    if device not in (None, "keep"):
        raise DockValueError(f"put(device=...) takes 'keep' (leave accelerator tensors in device memory) or "
                             f"None, got {device!r}")
    kept: dict[str, tuple[pb.ColumnData, Any]] = {}
    if device == "keep":
        for name, values in split.items():
            got = codec.device_column(name, values, _keeps)
            if got is not None:
                kept[name] = got
    body = codec.Body()
    codec.encode_columns({k: v for k, v in split.items() if k not in kept} if kept else split, body, req.columns)
    tensors = []
    for col, t in kept.values():
        t = device_share.base_layout(t)
        desc, base = device_share.export(t)
        req.device_buffers.append(desc)
        tensors.append(t)
        col.runs[0].device_buffer, col.runs[0].offset = len(req.device_buffers), base
        req.columns.append(col)
    req.token = ids.random_bits(63) | 1  # a re-sent put (after a dropped connection) is applied once

    def as_host() -> tuple[pb.PutRequest, codec.Body]:
        host = pb.PutRequest()
        host.CopyFrom(req)
        del host.device_buffers[:], host.columns[:]
        hbody = codec.Body()
        codec.encode_columns(split, hbody, host.columns)
        return host, hbody

    # a put with a timeout is given up (DockTimeout) after 2 x timeout + PUT_SLACK_S: its timeout bounds each
    # wait in the warehouse (room, pacing, an absent controller), and the slack covers storing and copying it
    deadline = None if timeout is None else time.monotonic() + 2 * timeout + PUT_SLACK_S
    return Put(req, body, kept=bool(kept), as_host=as_host, answer_s=(timeout or 0.0) + ANSWER_GRACE_S,
               deadline=deadline), tensors


def put(router: Router, warned: set[str], columns: Mapping[str, Any], *, partition: str,
        indexes: Sequence[int] | None, group_size: int, timeout: float | None, tags: Mapping[str, Any] | None,
        device: str | None, version: int | None) -> list[int]:
    """Dock.put to an ordinary partition (or a spread partition's shard): encoded, sent; its indexes."""
    req, tensors = put_request(columns, partition=partition, indexes=indexes, group_size=group_size,
                               timeout=timeout, tags=tags, device=device, version=version)
    try:
        return send(router, req, warned)
    finally:
        del tensors  # referenced until the put is answered: the warehouse copies out of them


def send(router: Router, put: Put, warned: set[str]) -> list[int]:
    """Send `put` to the home warehouse (re-homed and re-sent if it goes away); its indexes."""

    tried: list[int] = []

    def attempt(wid: int, pool: Pool) -> pb.Frame:
        # a re-send (its first answer was lost) is answered after its commit, which the put's token applies
        # once: from a block of new indexes it could be stored twice, once under each attempt's indexes
        put.req.resent = bool(tried)
        tried.append(wid)
        try:
            return pool.send(pool.via.put_request(put))
        except DockConnectionError:
            if not put.late:
                raise  # (a warehouse that went away or is silent: the router re-homes the put and re-sends it)
            raise DockTimeout(
                f"the put to partition {put.req.partition!r} was not answered within {put.req.timeout:g}s x 2 + "
                f"{PUT_SLACK_S:g}s by warehouse {wid} at {pool.address}, which is there (it answers probes) but did "
                "not finish it: is the dockd controller stopped or hung (`dockd status`)? The put was not "
                "acknowledged; it is still applied (once) if the warehouse finishes it later"
            ) from None

    reply = router.warehouse(attempt, put.deadline)
    if reply.put_reply.uncommitted or len(tried) > 1:  # (the next controller call on it flushes those commits)
        router.wrote(put.req.partition, tried[-1])
    if reply.put_reply.spilled_bytes and "spill" not in warned:
        warned.add("spill")
        logger.warning("[client] put(device='keep'): %d bytes were stored in host memory: the warehouse's device "
                       "tier is full or off (dockd serve --device-capacity); see dockd_device_spilled_bytes_total",
                       reply.put_reply.spilled_bytes)
    return list(reply.put_reply.indexes)


def _keeps(t) -> bool:
    """put(device="keep"): whether a tensor stays in device memory (a CUDA or NPU tensor; a CPU tensor
    only with DOCKD_CPU_DEVICE_TIER=1, which runs the device tier's paths on machines without one)."""
    return device_share.tiered(t.device.type)
