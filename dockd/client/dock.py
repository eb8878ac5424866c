"""The synchronous client: `Dock`.

    put  = one data round trip to this host's warehouse (which commits the
           metadata to the controller before acknowledging)
    get  = one acquire round trip to the controller (metadata only), then one
           fetch round trip per warehouse involved, in parallel, then a
           one-way confirm
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


import numpy as np

from dockd import auth, codec, device_share, limits, shm, wire
from dockd._proto import dockd_pb2 as pb
from dockd.client.batch import Batch
from dockd.client.connection import Credentials, Pool, timed_out
from dockd.client.links import LinkFailed, ReaderLinks
from dockd.client.router import CallScope, Router, call_on
from dockd.config import env_float
from dockd.errors import (
    DockClosed,
    DockConnectionError,
    DockDataLost,
    DockError,
    DockLeaseError,
    DockProtocolError,
    DockTimeout,
    DockTypeError,
    DockValueError,
    StagingUnknown,
)

logger = logging.getLogger(__name__)

_CONFIRM_DELAY = 0.02
FETCH_MIN_S = 1.0
"""Seconds a get's fetch may take at least, even when its acquire used up the get's timeout
(a get(timeout=0) of ready samples still gets this long to read them)."""
STATS_HELLO_TIMEOUT_S = 2.0
"""Seconds stats(traffic=True) waits for each warehouse's answer (one that does not answer gets an error)."""
UNRESPONSIVE_TRY_S = 0.5
"""Seconds a fetch waits for a warehouse the controller reports unresponsive (one that just resumed
answers at once; a stopped one makes the get raise DockTimeout after this, whatever its timeout)."""
CONFIRM_NOW_AFTER_S = 0.1
"""A get that took longer than this (from its acquire to the end of its fetch) confirms its lease
before returning, and returns nothing if the lease is gone: its samples were handed out again."""


def split_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str):
        raise DockTypeError(f"address must be a 'host:port' string, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DockValueError(f"address must look like 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


@dataclasses.dataclass(slots=True)
class Lease:
    """Samples acquired for a consumer but not fetched yet (low-level API).

    A lease belongs to the client that took it. To let another process confirm,
    release or extend it, hand it the lease with its `ticket` (it pickles); anyone
    may fetch its samples."""

    id: int
    partition: str
    columns: list[str]
    indexes: list[int]
    locations: np.ndarray | None  # warehouse id per (column, sample); None when every column came inline
    inline: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # columns that came with the acquire
    ticket: bytes = b""  # the hand-over proof (see the class docstring)
    step: int = 0        # rank-aware gets: the step this share belongs to
    rank_weights: list[float] = dataclasses.field(default_factory=list)  # ... each rank's sum of balance_by


class Dock:
    """A connection to a dock. Thread-safe; one per process is enough.

    Args:
        address: "host:port" of the controller (a warehouse's address works too:
            the client follows it to its controller).
        warehouse: where this client's puts go: a warehouse id or "host:port".
            Default: $DOCKD_WAREHOUSE, else a warehouse on this host (spread by
            process id when there are several), else any. Unpinned clients move
            to another live warehouse when theirs goes away; pinned ones wait for it.
        connect_timeout: seconds to wait when connecting to a daemon (also how
            long the first connection waits for a controller that is not up yet).
        reconnect_timeout: seconds to keep retrying a daemon that went away
            (a controller restarting, a warehouse to re-home from) before a call
            fails with DockConnectionError. Default $DOCKD_RECONNECT_TIMEOUT or 30.
        token: the dock's token, if its daemons were started with one (default:
            $DOCKD_TOKEN, else the file named by $DOCKD_TOKEN_FILE). It never
            leaves this process: connections prove it by challenge-response.
        name: a name for this client in the daemons' logs.
        fetch_timeout: seconds a read from the warehouses may wait for them to answer when the call
            has no timeout of its own (get(timeout=None), fetch, read). Default
            $DOCKD_FETCH_TIMEOUT or 60, half the daemons' default lease timeout, so a warehouse that
            stopped answering makes the get raise DockTimeout while its lease still holds.
    """

    def __init__(self, address: str, *, warehouse: int | str | None = None, connect_timeout: float | None = None,
                 reconnect_timeout: float | None = None, token: str | bytes | None = None, name: str = "",
                 fetch_timeout: float | None = None) -> None:
        self.connect_timeout = connect_timeout if connect_timeout is not None else env_float("DOCKD_CONNECT_TIMEOUT", 10.0)
        self.reconnect_timeout = (reconnect_timeout if reconnect_timeout is not None
                                  else env_float("DOCKD_RECONNECT_TIMEOUT", 30.0))
        self.fetch_timeout = fetch_timeout if fetch_timeout is not None else env_float("DOCKD_FETCH_TIMEOUT", 60.0)
        if not self.fetch_timeout > 0:
            raise DockValueError(f"fetch_timeout must be > 0 seconds, got {self.fetch_timeout}")
        host, port = split_address(address)
        self._name = name or f"pid{os.getpid()}"
        self._lock = threading.Lock()
        self._closed = False
        self._confirms: list[int] = []  # leases fetched but not yet confirmed to the controller
        self._confirm_lock = threading.Lock()
        self._confirm_wake = threading.Event()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._warned_recovered: set[str] = set()
        self._warned: set[str] = set()  # one-time warnings given
        self._links = ReaderLinks()  # device links to warehouses on other nodes (get(device=...))
        self._device_tiers: dict[int, bool] = {}  # warehouse -> whether it has a device tier
        pinned = warehouse if warehouse is not None else os.environ.get("DOCKD_WAREHOUSE")
        prefer = None
        if "ray" in sys.modules and (not pinned or token is None):
            # inside Ray, for a dock dockd.ray launched: this Ray node's warehouse, and the dock's token
            from dockd import ray as dock_ray

            prefer, ray_token = dock_ray.home_for(address)
            if token is None and not os.environ.get("DOCKD_TOKEN") and not os.environ.get("DOCKD_TOKEN_FILE"):
                token = ray_token
        # the session owns this client's leases; it is random, so nobody else can claim them
        self._creds = Credentials(key=auth.client_token(token), session=secrets.token_bytes(16), name=self._name)
        self._router = Router(host, port, warehouse=pinned, connect_timeout=self.connect_timeout,
                              reconnect_timeout=self.reconnect_timeout, name=self._name, stop=self._stop, prefer=prefer,
                              creds=self._creds)
        # a Dock dropped without close() (or failing here) still stops its flusher and closes its sockets
        self._finalizer = weakref.finalize(self, _finalize, self._stop, self._confirm_wake, self._router)
        self._executor: ThreadPoolExecutor | None = None
        try:
            self._router.connect()
        except BaseException:
            self._finalizer()
            raise
        r = self._router
        w = r.warehouses.get(r.home)
        # (the home warehouse is not contacted here: its connections are made by the first put)
        logger.info("[client] connected controller=%s transport=%s home_warehouse=%d address=%s",
                    r.address, r.ctrl.transport, r.home, f"{w.host}:{w.port}" if w else "-")

    @property
    def address(self) -> str:
        """The controller's "host:port"."""
        return self._router.address

    @property
    def home(self) -> int:
        """Id of the warehouse this client's puts go to."""
        return self._router.home

    def _ctrl_call(self, frame: pb.Frame, *, timeout: float | None = None, deadline: float | None = None,
                   scope: CallScope | None = None) -> tuple[pb.Frame, np.ndarray, list[int]]:
        """A controller request, re-sent after a reconnect if the connection drops. Pending
        confirms are delivered first, so the call sees this client's own gets applied."""
        self._send_confirms(self._take_confirms())
        return self._router.controller(lambda pool: call_on(pool, frame, timeout=timeout, scope=scope),
                                       deadline=deadline)

    # -- public API ---------------------------------------------------------------------------
    def put(self, columns: Mapping[str, Any], *, partition: str, indexes: Sequence[int] | None = None,
            group_size: int = 1, timeout: float | None = None,
            tags: Mapping[str, int | Sequence[int]] | None = None, device: str | None = None,
            version: int | None = None) -> list[int]:
        """Write samples; returns their indexes. Returns once the data is stored and visible.

        Without `indexes`, creates new samples (a multiple of `group_size`, each
        run of `group_size` consecutive samples one group). With `indexes`, adds
        columns to existing samples (also those `reserve` handed out). `timeout`
        bounds the wait for warehouse capacity (None: wait as long as it takes),
        then DockFull. `tags`: integer tags of these samples, such as
        ``{"age": 0}`` (one value for all, or a list with one per sample), that
        gets can filter (`where`) and order (`order_by`) by; `set_tags` changes
        them later.

        `version`: the policy version (an int >= 0) that produced these samples: the reserved tag
        "version" (a sample put without one counts as version 0). Gets with a staleness bound
        (`max_staleness`) hand out the oldest version first and never one older than the trainer's
        version (`set_version`) minus the bound. A put of new samples to a partition with
        `max_pending` waits while that many samples wait for its consumers (up to `timeout`,
        then DockFull).

        `device="keep"`: tensor columns on an accelerator (CUDA, or NPU with torch_npu) stay in device
        memory: the home warehouse, on the same node, copies them device to device
        into its device tier (`dockd serve --device-capacity`) instead of receiving
        them through host memory. When its device tier is full or off they are
        stored in host memory (spilled: logged, counted in the metric
        dockd_device_spilled_bytes_total). Other columns are put as usual.
        """
        _check_partition(partition)
        if not isinstance(columns, Mapping) or not columns:
            raise DockTypeError("columns must be a non-empty dict of column name -> values")
        split = {}
        for name, values in columns.items():
            if not isinstance(name, str) or not name:
                raise DockTypeError(f"column names must be non-empty strings, got {name!r}")
            _text(name, "column name")
            t = codec.batched(values)  # kept whole: encoded as one buffer
            split[name] = t if t is not None else codec.split_column(name, values)
        counts = {k: codec.column_length(v) for k, v in split.items()}
        n = next(iter(counts.values()))
        if n == 0 or len(set(counts.values())) != 1:
            raise DockValueError(f"every column needs the same positive number of values, got {counts}")
        timeout = _seconds(timeout)
        req = pb.PutRequest(partition=partition, timeout=-1.0 if timeout is None else timeout)
        if indexes is None:
            if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
                raise DockValueError(f"group_size must be a positive int, got {group_size!r}")
            if n % group_size:
                raise DockValueError(f"{n} new samples is not a multiple of group_size={group_size}")
            req.new_count, req.group_size = n, group_size
        else:
            idx = _int_list("indexes", indexes)
            if len(idx) != n:
                raise DockValueError(f"{len(idx)} indexes given for {n} values per column")
            req.indexes.extend(idx)
        if version is not None:
            if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or version < 0:
                raise DockValueError(f"version is the policy version that produced the samples, an int >= 0, "
                                     f"got {version!r}")
            if tags and "version" in tags:
                raise DockValueError("give the policy version as version=..., or as tags={'version': ...}, not both")
            tags = {**(tags or {}), "version": int(version)}
        if tags:
            req.tags.extend(_tag_list(tags, n))
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
        req.columns.extend(codec.encode_columns({k: v for k, v in split.items() if k not in kept}, body))
        tensors = []  # referenced until the put is answered: the warehouse copies out of them
        for col, t in kept.values():
            t = device_share.base_layout(t)
            desc, base = device_share.export(t)
            req.device_buffers.append(desc)
            tensors.append(t)
            col.runs[0].device_buffer, col.runs[0].offset = len(req.device_buffers), base
            req.columns.append(col)
        req.token = secrets.randbits(63) | 1  # a re-sent put (after a dropped connection) is applied once

        def send(wid: int, pool: Pool):
            if kept and not pool.unix:  # device memory is shared by handle on one node only: send it as bytes
                host = pb.PutRequest()
                host.CopyFrom(req)
                del host.device_buffers[:], host.columns[:]
                hbody = codec.Body()
                host.columns.extend(codec.encode_columns(split, hbody))
                if "tcp-keep" not in self._warned:
                    self._warned.add("tcp-keep")
                    logger.warning("[client] put(device='keep') to warehouse %d over TCP (not the same node, or "
                                   "DOCKD_TRANSPORT=tcp): its device columns are sent and stored as host bytes", wid)
                reply, _, _ = call_on(pool, pb.Frame(put=host), hbody.buffers, hbody.size)
                return reply
            if pool.unix and body.size >= shm.SHM_MIN_BODY:
                return self._put_shm(pool, req, body)
            reply, _, _ = call_on(pool, pb.Frame(put=req), body.buffers, body.size)
            return reply

        reply = self._router.warehouse(send)
        del tensors
        if reply.put_reply.spilled_bytes and "spill" not in self._warned:
            self._warned.add("spill")
            logger.warning("[client] put(device='keep'): %d bytes were stored in host memory: the warehouse's device "
                           "tier is full or off (dockd serve --device-capacity); see dockd_device_spilled_bytes_total",
                           reply.put_reply.spilled_bytes)
        return list(reply.put_reply.indexes)

    def _put_shm(self, pool: Pool, req: pb.PutRequest, body: codec.Body) -> pb.Frame:
        """Copy the payload into a warm staging buffer (the one copy here) and name it; the warehouse
        copies it into its own storage before it answers (see dockd.client.staging)."""
        buf = pool.staging.take(body.size)
        try:
            dst = memoryview(buf.view)
            off = 0
            for b in body.buffers:
                src = memoryview(b).cast("B")
                dst[off : off + src.nbytes] = src
                off += src.nbytes
            req.staging, req.shm_size = buf.id, body.size
            for attempt in (0, 1):
                try:
                    reply, _, _ = call_on(pool, pb.Frame(put=req), fds=[] if buf.registered else [buf.fd])
                    break
                except StagingUnknown:  # the warehouse dropped our registration (many buffers, a restart)
                    if attempt:
                        raise
                    buf.registered = False
            buf.registered = True
        finally:
            pool.staging.give(buf)
        return reply

    def get(self, consumer: str, columns: Sequence[str], count: int, *, partition: str, timeout: float | None = None,
            groups: bool = False, allow_partial: bool = False, shuffle: bool = False, seed: int | None = None,
            dp_rank: int | None = None, dp_size: int | None = None, mp_group: tuple[int, int, int] | None = None,
            step: int | None = None, balance_by: str | Sequence[str] | None = None,
            where: Mapping[str, Any] | None = None, order_by: str | None = None, prefer_local: bool = False,
            device: str | Any | None = None, max_staleness: int | None = None, _scope: CallScope | None = None) -> Batch:
        """Take `count` samples ready in `columns` that `consumer` has not had yet.

        Blocks until they are ready; after `timeout` seconds raises DockTimeout
        saying how many were ready (None: wait as long as it takes). FIFO by
        index unless shuffle=True (seeded by `seed`). groups=True hands out
        whole groups only. allow_partial=True returns what is ready (at least
        one sample) instead of waiting for `count`. prefer_local=True hands out
        first the ready samples whose columns are all on this client's home
        warehouse (its own node's, by default), then the others in the usual
        order: reads stay on the node where they can, at the price of strict
        FIFO (and a scan of the partition per get). Once the partition is
        sealed (`seal`) a get takes what is left, and raises DockDrained when
        nothing is.

        Tags: `where={"age": (lo, hi)}` (or a single value) takes only samples
        whose tag lies in [lo, hi] (None for an open end); `order_by="age"`
        hands out the smallest values first ("-age": the largest).

        Staleness (asynchronous RL): `max_staleness=s` hands out only samples whose policy
        version (put(version=...)) is >= the trainer's version (`set_version`) minus s, oldest
        version first, then by index (unless `order_by` says otherwise); default: the partition's
        `max_staleness` (create_partition), if any.

        Rank-aware gets (see docs/rl.md): with `dp_rank` and `dp_size`, the
        dp_size data-parallel ranks of one step together take one global batch
        of count * dp_size samples and this rank gets its `count` of them:
        balanced so that the per-rank sums of `balance_by` (a tag, a column of
        numbers, or a tensor column whose per-sample numel counts; or a list of
        those, summed) are as equal as possible, else split by position. A rank
        asking again before its share is confirmed gets the same share (`step`:
        a given step; default the next one this rank has not finished).
        `mp_group=(group_id, rank_in_group, group_size)`: all ranks of one
        model-parallel group get the same samples, and they are taken once
        every rank of the group read them (group_id is the group's data-parallel
        rank when dp_size is given; without it, each group takes its own batches).
        `batch.step` is the step, `batch.rank_weights` the ranks' weight sums.

        `device` (e.g. "cuda:0"): tensors come back on that device. Host-tier
        columns are copied host-to-device in one piece through a pinned buffer;
        device-tier data is copied device to device from a warehouse on this
        node, and received over a device link (NCCL; HCCL on NPUs) from one on another node.

        A warehouse that does not answer the fetch within what is left of `timeout`
        (at least FETCH_MIN_S; with no timeout, `fetch_timeout`) makes the get raise
        DockTimeout naming it; so does one the controller reports unresponsive, at
        once. The lease is released first: the samples go back to the pool, nothing
        is lost, and a late answer is never handed to anyone. A get that took long
        enough for its lease to expire confirms it before returning and raises
        DockLeaseError rather than return samples that were handed out again.
        """
        target = _device(device)
        started = time.monotonic()
        reconnects = self._router.reconnects
        lease = self.acquire(consumer, columns, count, partition=partition, timeout=timeout, groups=groups,
                             allow_partial=allow_partial, shuffle=shuffle, seed=seed, dp_rank=dp_rank,
                             dp_size=dp_size, mp_group=mp_group, step=step, balance_by=balance_by, where=where,
                             order_by=order_by, prefer_local=prefer_local, max_staleness=max_staleness, _scope=_scope,
                             _lazy=True)
        if _scope is not None and _scope.cancelled:  # cancelled as the lease arrived: give it back, take nothing
            self.release(lease)
            raise DockClosed("the get was cancelled")
        left = self.fetch_timeout if timeout is None else max(FETCH_MIN_S, started + timeout - time.monotonic())
        try:
            values = self._fetch(lease, lazy=True, device=target if _maps_device(target) else None,
                                 deadline=time.monotonic() + left)
        except BaseException:
            self._release_now(lease)
            raise
        if lease.id:  # (0: a share every reader of it already confirmed; nothing to confirm)
            if time.monotonic() - started > CONFIRM_NOW_AFTER_S or self._router.reconnects != reconnects:
                self._confirm_now(lease, time.monotonic() - started)  # the lease may be gone: check before handing out
            else:
                self._confirm_soon(lease.id)
        batch = Batch(partition, lease.indexes, values, step=lease.step, rank_weights=lease.rank_weights)
        if target is not None:
            batch = Batch(partition, lease.indexes, {c: _to_device(batch[c], target) for c in columns},
                          step=lease.step, rank_weights=lease.rank_weights)
        return batch

    def acquire(self, consumer: str, columns: Sequence[str], count: int, *, partition: str, timeout: float | None = None,
                groups: bool = False, allow_partial: bool = False, shuffle: bool = False, seed: int | None = None,
                inline: bool = True, lease_timeout: float | None = None, dp_rank: int | None = None,
                dp_size: int | None = None, mp_group: tuple[int, int, int] | None = None, step: int | None = None,
                balance_by: str | Sequence[str] | None = None, where: Mapping[str, Any] | None = None,
                order_by: str | None = None, prefer_local: bool = False, max_staleness: int | None = None,
                _scope: CallScope | None = None, _lazy: bool = False) -> Lease:
        """Low-level: lease samples without fetching them (see get).

        With inline=True (the default) the values held by the controller's own
        warehouse come back with the lease (`lease.inline`), saving their fetch.
        inline=False returns metadata only, with a location for every column:
        use it to hand the lease to other processes that fetch for themselves.
        lease_timeout: seconds this lease stays with this client before its
        samples return to the pool (default: the daemon's --lease-timeout), for
        consumers that work on leased samples for long. A lease always returns
        when its client dies; `extend` moves the deadline later. The rank-aware
        and tag arguments are get's."""
        _check_partition(partition)
        if not isinstance(consumer, str) or not consumer:
            raise DockValueError(f"consumer must be a non-empty string such as 'actor_train', got {consumer!r}")
        if isinstance(columns, str) or not isinstance(columns, Sequence) or not columns or not all(isinstance(c, str) for c in columns):
            raise DockTypeError(f"columns must be a non-empty list of column names, got {columns!r}")
        if len(set(columns)) != len(columns):
            raise DockValueError(f"columns contains duplicates: {list(columns)}")
        for name in (consumer, *columns):
            _text(name, "consumer or column name")
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 1:
            raise DockValueError(f"count must be a positive int, got {count!r}")
        timeout = _seconds(timeout)
        req = pb.AcquireRequest(partition=partition, consumer=consumer, columns=list(columns), count=int(count),
                                groups=groups, allow_partial=allow_partial, shuffle=shuffle, inline=inline,
                                timeout=-1.0 if timeout is None else float(timeout))
        if seed is not None:
            req.has_seed, req.seed = True, int(seed)
        _rank_fields(req, dp_rank, dp_size, mp_group, step, balance_by)
        if where:
            req.where.extend(_where_list(where))
        if max_staleness is not None:
            if not isinstance(max_staleness, (int, np.integer)) or isinstance(max_staleness, bool) or max_staleness < 0:
                raise DockValueError(f"max_staleness is an int >= 0 (policy versions behind the trainer's), "
                                     f"got {max_staleness!r}")
            req.max_staleness = int(max_staleness) + 1
        if prefer_local and self._router.home >= 0:
            if req.dp_size:
                raise DockValueError("prefer_local does not apply to rank-aware gets (dp_size or mp_group): a "
                                     "step's batch is one for all ranks")
            req.near = self._router.home + 1
        if order_by:
            if not isinstance(order_by, str):
                raise DockTypeError(f"order_by names a tag such as 'age' (or '-age' for largest first), got {order_by!r}")
            req.order_by = order_by
        if lease_timeout is not None:
            if not 0 < lease_timeout <= 7 * 86400:
                raise DockValueError(f"lease_timeout must be in (0, one week] seconds, got {lease_timeout}")
            req.lease_seconds = float(lease_timeout)
        req.token = secrets.randbits(63) | 1  # a retried acquire gets the lease its lost reply carried
        confirms = self._take_confirms()
        req.confirm.extend(confirms)
        deadline = None if timeout is None else time.monotonic() + timeout

        used: list[Pool] = []

        def send(pool: Pool):
            if deadline is not None:  # a retry after a reconnect waits only for what is left
                req.timeout = max(0.0, deadline - time.monotonic())
            used[:] = [pool]
            return call_on(pool, pb.Frame(acquire=req), scope=_scope,
                           timeout=None if timeout is None else req.timeout + 30.0)

        try:
            reply, body, fds = self._router.controller(send, deadline=deadline)
        except DockConnectionError:
            self._return_confirms(confirms)
            raise
        except BaseException as e:
            if not isinstance(e, DockError):  # interrupted (Ctrl-C, cancelled): a lease may be on its way to us
                self._release_token(req.token)
            raise
        a = reply.acquire_reply
        self._router.learn(a.warehouses)
        if a.recovered and partition not in self._warned_recovered:
            self._warned_recovered.add(partition)
            logger.warning(
                "[client] partition %r was rebuilt after a controller restart without a state dir: samples this "
                "consumer took before the restart can be handed out again (start the controller with --state-dir "
                "to keep consumer progress)", partition)
        idx = list(a.indexes)
        inline = dict(zip((c.name for c in a.inline),
                          decode_reply(a.inline, body, fds, reply.pins, self._unpinner(used[0]), lazy=_lazy)))
        locs = None  # only needed to fetch what did not come inline
        if len(inline) < len(columns):
            locs = np.asarray(a.locations, dtype=np.int64).reshape(len(columns), len(idx))
        return Lease(a.lease, partition, list(columns), idx, locs, inline, bytes(a.ticket), a.step, list(a.rank_weights))

    def _release_now(self, lease: Lease) -> None:
        """Give back the lease of a get that failed, within connect_timeout (best effort: the controller
        also frees it when the lease expires or this client goes away)."""
        frame = pb.Frame(release=pb.ReleaseRequest(lease=lease.id, ticket=lease.ticket))
        limit = self.connect_timeout
        try:
            self._router.controller(lambda pool: call_on(pool, frame, timeout=limit), deadline=time.monotonic() + limit)
        except Exception as e:  # noqa: BLE001 - never mask the error that made the get fail
            logger.warning("[client] could not release lease=%d after a failed fetch: %s", lease.id, e)

    def _confirm_now(self, lease: Lease, took: float) -> None:
        """Confirm a get's lease before its values are returned; DockLeaseError if it is gone (expired,
        or released with this client's session), so samples handed out again are never returned.
        A controller that cannot be reached leaves the confirm pending, as for any get."""
        leases = [*self._take_confirms(), lease.id]
        frame = pb.Frame(confirm=pb.ConfirmRequest(leases=leases))
        limit = self.connect_timeout
        try:
            reply, _, _ = self._router.controller(lambda pool: call_on(pool, frame, timeout=limit),
                                                  deadline=time.monotonic() + limit)
        except DockConnectionError as e:
            logger.warning("[client] could not confirm lease=%d (%s); it goes out with the next request", lease.id, e)
            self._return_confirms(leases)
            self._confirm_wake.set()
            return
        r = reply.confirm_reply
        gone = set(r.unknown) | set(r.refused)
        if len(gone - {lease.id}):
            logger.warning("[client] %d of %d leases expired before their confirm reached the controller: their "
                           "samples were handed out again (consider a longer --lease-timeout)",
                           len(gone - {lease.id}), len(leases) - 1)
        if lease.id in gone:
            raise DockLeaseError(
                f"this get's lease {lease.id} on {len(lease.indexes)} samples of partition {lease.partition!r} expired "
                f"or was released while the get took {took:.1f}s: the samples were handed out again, so they are not "
                "returned here (nothing is lost: another get received them). Raise the daemon's --lease-timeout or "
                "read smaller batches."
            )

    def _stuck(self, lease: Lease, parts, wid: int, why: str) -> DockTimeout:
        """The error of a read whose warehouse does not answer: the lease is released by the caller."""
        cols = [c for c, _ in parts]
        n = len({i for c, pos in parts for i in (lease.indexes if pos is None else np.asarray(lease.indexes)[pos].tolist())})
        return DockTimeout(
            f"cannot read columns {cols} of {n} samples of partition {lease.partition!r} from warehouse {wid} at "
            f"{self._router.address_of(wid)}: {why}. The samples stay in the dock (a get's lease is released, "
            "so they are handed out again); retry later, or see `dockd status` for the warehouse's state"
        )

    def _call_fetch(self, wid: int, pool, req: pb.FetchRequest, device, timeout: float | None = None) -> tuple:
        """A fetch on `pool`: reply, body, descriptors, and the device buffers received over a device link
        (None without one). A reader that maps device memory takes device-tier data by handle from a
        same-node warehouse, and over a device link from one on another node with a device tier.
        `timeout` bounds the wait for the warehouse's answer (a reply that keeps arriving may take longer)."""
        req.device = device is not None and bool(pool.unix)
        call = functools.partial(call_on, pool, timeout=timeout, stall=timeout)
        if device is None or pool.unix or not self._has_device_tier(wid):
            return (*call(pb.Frame(fetch=req)), None)
        if device.type != "cpu" and device.index is None:  # a link is bound to one device
            import torch

            device = torch.device(device.type, getattr(torch, device.type).current_device())
        return self._links.fetch(wid, pool.host, device, req, call)

    def _has_device_tier(self, wid: int) -> bool:
        tier = self._device_tiers.get(wid)
        if tier is None:
            tier = self._device_tiers[wid] = self._router.hello(wid).device_capacity > 0
        return tier

    def fetch(self, lease: Lease, *, timeout: float | None = None) -> dict[str, list[Any]]:
        """Low-level: read a lease's values from the warehouses holding them, in parallel. A warehouse
        that does not answer within `timeout` seconds (default `fetch_timeout`) raises DockTimeout
        naming it; the lease is left as it is (release it, or fetch again)."""
        timeout = _seconds(timeout)
        limit = self.fetch_timeout if timeout is None else timeout
        return self._fetch(lease, lazy=False, deadline=time.monotonic() + limit)

    def _fetch(self, lease: Lease, *, lazy: bool, device=None, deadline: float | None = None) -> dict[str, Any]:
        """Values per column: lists, or with `lazy` the received runs where a column came whole
        from one place (made into a list only when asked for; see Batch). Each warehouse has until
        `deadline` (default: fetch_timeout from now) to answer, else DockTimeout."""
        if deadline is None:
            deadline = time.monotonic() + self.fetch_timeout
        n = len(lease.indexes)
        idx = np.asarray(lease.indexes, dtype=np.int64)
        plan: dict[int, list[tuple[str, np.ndarray]]] = {}
        for ci, col in enumerate(lease.columns):
            if col in lease.inline:
                continue
            row = lease.locations[ci]
            first = int(row[0])
            if (row == first).all():
                plan.setdefault(first, []).append((col, None))
                continue
            for wid in np.unique(row).tolist():
                plan.setdefault(wid, []).append((col, np.flatnonzero(row == wid)))

        def one(wid: int, device=device) -> list[list[Any]]:
            started = time.monotonic()
            until = deadline
            info = self._router.warehouses.get(wid)
            silent = info is not None and info.state == "unresponsive"  # (as the controller said with this lease)
            if silent:  # a short try: one that just resumed answers at once
                until = min(until, started + UNRESPONSIVE_TRY_S)

            def left() -> float:
                return max(0.001, until - time.monotonic())

            req = pb.FetchRequest(partition=lease.partition)
            for col, pos in plan[wid]:
                req.columns.add(name=col, indexes=lease.indexes if pos is None else idx[pos].tolist())
            try:
                try:
                    pool = self._router.pool(wid, left())
                    reply, body, fds, received = self._call_fetch(wid, pool, req, device, left())
                except DockConnectionError as e:  # a stale pooled connection: one more try on a fresh one
                    if timed_out(e) or until <= time.monotonic():
                        raise
                    self._router.forget(wid)
                    pool = self._router.pool(wid, left())
                    reply, body, fds, received = self._call_fetch(wid, pool, req, device, left())
            except LinkFailed as e:
                logger.warning("[client] %s; reading that data through host memory", e)
                return one(wid, None)
            except DockConnectionError as e:
                if timed_out(e):  # there, but silent: its connections are dropped, so a late answer is never read
                    self._router.forget(wid)
                    why = (f"the controller reports that it stopped answering, and it did not answer within "
                           f"{time.monotonic() - started:.1f}s either" if silent else
                           f"it did not answer within {time.monotonic() - started:.1f}s")
                    raise self._stuck(lease, plan[wid], wid, why + " (a stopped, hung or overloaded process?)") from None
                cols = [c for c, _ in plan[wid]]
                lost = sorted({i for c, pos in plan[wid] for i in (lease.indexes if pos is None else idx[pos].tolist())})
                raise DockDataLost(
                    f"cannot read columns {cols} of {len(lost)} samples from warehouse {wid}: {e}",
                    indexes=lost, columns=cols,
                ) from None
            r = reply.fetch_reply
            try:
                return decode_reply(r.columns, body, fds, reply.pins, self._unpinner(pool), lazy=lazy,
                                    shared=r.device_buffers if received is None else (), received=received,
                                    device=device)
            except DockValueError as e:  # device memory this process cannot map: take it as bytes instead
                if not r.device_buffers or received is not None:
                    raise
                logger.warning("[client] cannot map warehouse %d's device memory (%s); reading it as host bytes", wid, e)
                return one(wid, None)

        wids = list(plan)
        if not wids:
            results = []
        elif len(wids) == 1:
            results = [one(wids[0])]
        else:
            results = list(self._pool_executor().map(one, wids))
        out: dict[str, Any] = dict(lease.inline)
        if not lazy:
            out = {c: v.values() if isinstance(v, codec.Runs) else v for c, v in out.items()}
        for wid, cols in zip(wids, results):
            for (col, pos), values in zip(plan[wid], cols):
                if pos is None:
                    out[col] = values
                else:  # a column spread over warehouses: put each part in its place
                    dst = out.setdefault(col, [None] * n)
                    for p, v in zip(pos.tolist(), values.values() if isinstance(values, codec.Runs) else values):
                        dst[p] = v
        return {c: out[c] for c in lease.columns}

    def read(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> Batch:
        """Read written samples by index without taking them for any consumer.

        Raises DockNotFound when an index does not exist or a column is not
        written for it yet (read never waits)."""
        _check_partition(partition)
        if isinstance(columns, str) or not columns:
            raise DockTypeError(f"columns must be a non-empty list of column names, got {columns!r}")
        idx = _int_list("indexes", indexes)
        if not idx:
            raise DockValueError("indexes is empty")
        req = pb.LocateRequest(partition=partition, indexes=idx, columns=list(columns))
        reply, _, _ = self._ctrl_call(pb.Frame(locate=req))
        loc = reply.locate_reply
        self._router.learn(loc.warehouses)
        locs = np.asarray(loc.locations, dtype=np.int64).reshape(len(columns), len(idx))
        values = self._fetch(Lease(0, partition, list(columns), idx, locs), lazy=True)
        return Batch(partition, idx, values)

    def confirm(self, lease: Lease) -> None:
        """Low-level: the lease's samples were fetched; they are taken for good.

        Raises DockLeaseError if the lease expired or was released first (its samples
        were handed out again), or belongs to another client and `lease.ticket` is missing.
        A lease whose partition was cleared meanwhile confirms quietly (nothing was handed out)."""
        self._send_confirms(self._take_confirms())
        frame = pb.Frame(confirm=pb.ConfirmRequest(leases=[lease.id], tickets=[lease.ticket]))
        reply, _, _ = self._router.controller(lambda pool: call_on(pool, frame))
        r = reply.confirm_reply
        if r.refused:
            raise DockLeaseError(f"lease {lease.id} belongs to another client: hand it over with its ticket")
        if r.unknown:
            raise DockLeaseError(
                f"lease {lease.id} expired or was released before this confirm: its {len(lease.indexes)} samples "
                "were handed out again. Confirm sooner, extend it (dock.extend, or acquire(lease_timeout=...)), or "
                "raise the daemon's --lease-timeout."
            )

    def extend(self, lease: Lease, seconds: float | None = None) -> float:
        """Low-level: keep a lease `seconds` longer from now (default: the dock's lease timeout);
        returns the seconds it now has. DockLeaseError if it already expired or is another client's."""
        if seconds is not None and not seconds > 0:
            raise DockValueError(f"seconds must be > 0, got {seconds}")
        req = pb.ExtendRequest(lease=lease.id, ticket=lease.ticket, seconds=seconds or 0.0)
        reply, _, _ = self._ctrl_call(pb.Frame(extend=req))
        return reply.extend_reply.seconds

    # Confirms of gets ride on the next acquire, or go out on their own after
    # _CONFIRM_DELAY: a get then costs one wake-up of the controller, not two.
    # Until confirmed, the controller would give the samples back if this
    # client died, which is the safe direction.
    def _confirm_soon(self, lease_id: int) -> None:
        with self._confirm_lock:
            self._confirms.append(lease_id)
            if self._flusher is None:
                self._flusher = threading.Thread(target=_flush_loop, args=(weakref.ref(self), self._confirm_wake, self._stop),
                                                 name="dockd-confirm", daemon=True)
                self._flusher.start()
        self._confirm_wake.set()

    def _take_confirms(self) -> list[int]:
        with self._confirm_lock:
            out, self._confirms = self._confirms, []
        return out

    def _return_confirms(self, leases: list[int]) -> None:
        """Confirms that did not reach the controller go out again with the next request."""
        if leases:
            with self._confirm_lock:
                self._confirms[:0] = leases

    def _send_confirms(self, leases: list[int], *, retry: bool = True) -> None:
        """Deliver confirms and wait for the controller's answer (a one-way frame to a controller
        that just died would vanish without an error); on failure they stay pending."""
        if not leases:
            return
        frame = pb.Frame(confirm=pb.ConfirmRequest(leases=leases))
        try:
            if retry:
                reply, _, _ = self._router.controller(lambda pool: call_on(pool, frame))
            else:
                reply, _, _ = call_on(self._router.ctrl, frame, timeout=self.connect_timeout)
        except BaseException:
            self._return_confirms(leases)
            raise
        late = len(reply.confirm_reply.unknown) + len(reply.confirm_reply.refused)
        if late:  # the gets already returned: say it, the samples were handed out again
            logger.warning("[client] %d of %d leases expired before their confirm reached the controller: their "
                           "samples were handed out again (consider a longer --lease-timeout)", late, len(leases))

    def release(self, lease: Lease) -> int:
        """Low-level: give a lease's samples back to the pool for this consumer."""
        reply, _, _ = self._ctrl_call(pb.Frame(release=pb.ReleaseRequest(lease=lease.id, ticket=lease.ticket)))
        return reply.release_reply.released

    def _send_unpins(self) -> None:
        """Tell same-host warehouses which of their segments this process no longer maps (one-way;
        a lost one only keeps a segment from being reused until this process exits)."""
        for pool in list(self._router.all_pools):
            if not pool.unix:
                continue
            sids = pool.take_unpins()
            if not sids:
                continue
            try:
                conn = pool.get()
                try:
                    conn.post(pb.Frame(oneway=True, unpin=sids))
                finally:
                    pool.put(conn)
            except DockError as e:
                logger.debug("[client] could not send unpins: %s", e)

    def _unpinner(self, pool: Pool) -> Callable[[int], None]:
        """What a zero-copy mapping of `pool`'s daemon calls when it is gone: queue the unpin (it
        rides on the next request to that daemon, or the flusher sends it)."""
        wake = self._confirm_wake

        def unpin(sid: int) -> None:
            pool.unpin(sid)
            wake.set()

        return unpin

    def _release_token(self, token: int) -> None:
        """Give back whatever lease an interrupted acquire got, so no sample stays leased to a call
        nobody waits for (best effort: otherwise the lease expires)."""
        frame = pb.Frame(release=pb.ReleaseRequest(token=token))
        try:
            call_on(self._router.ctrl, frame, timeout=self.connect_timeout)
        except BaseException as e:  # noqa: BLE001 - never mask the interruption itself
            logger.debug("[client] could not release an interrupted acquire: %s", e)

    def clear(self, partition: str) -> int:
        """Free a partition's data on every warehouse and forget its metadata; returns its sample count."""
        _check_partition(partition)
        reply, _, _ = self._ctrl_call(pb.Frame(clear=pb.ClearRequest(partition=partition)))
        return reply.clear_reply.samples

    # -- partitions and their samples --------------------------------------------------------------
    def _partition_op(self, partition: str, **op) -> pb.PartitionReply:
        _check_partition(partition)
        reply, _, _ = self._ctrl_call(pb.Frame(partition=pb.PartitionRequest(partition=partition, **op)))
        return reply.partition_reply

    def create_partition(self, partition: str, *, group_size: int = 1,
                         retire_when_consumed_by: Sequence[str] = (), max_staleness: int | None = None,
                         retire_stale: bool = False, max_pending: int | None = None) -> None:
        """Make a partition ahead of its first put, or set its options (each call sets all of them).

        retire_when_consumed_by: consumers that must all have confirmed a sample
        before it is deleted by itself (all its columns freed on every
        warehouse): a long-running partition then holds only live samples.
        Samples all of them already took go at once.

        max_staleness: gets hand out only samples whose policy version is >= the trainer's
        version (`set_version`) minus this, oldest version first (a get's own `max_staleness`
        overrides it). Samples staler than that, not yet taken by the partition's consumers, are
        counted in `stats()["partitions"][p]["stale"]`; with retire_stale=True they are deleted
        when set_version makes them stale (counted in "stale_retired").

        max_pending: a put of new samples waits while this many samples of the partition are
        written and not yet handed out to all its consumers (the consumers named by
        retire_when_consumed_by, else every consumer that asked for its samples; before any
        consumer asked, every sample counts), up to the put's timeout, then DockFull. A get
        (lease) of a consumer opens the slots; see docs/rl.md."""
        retire = [retire_when_consumed_by] if isinstance(retire_when_consumed_by, str) else list(retire_when_consumed_by)
        if not all(isinstance(c, str) and c for c in retire):
            raise DockTypeError(f"retire_when_consumed_by lists consumer names, got {retire_when_consumed_by!r}")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise DockValueError(f"group_size must be a positive int, got {group_size!r}")
        for name, v in (("max_staleness", max_staleness), ("max_pending", max_pending)):
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0):
                raise DockValueError(f"{name} must be an int >= 0 or None, got {v!r}")
        if retire_stale and max_staleness is None:
            raise DockValueError("retire_stale=True needs max_staleness: it deletes samples staler than that")
        self._partition_op(partition, create=pb.CreatePartition(
            group_size=group_size, retire_when_consumed_by=retire, retire_stale=bool(retire_stale),
            max_staleness=0 if max_staleness is None else int(max_staleness) + 1, max_pending=int(max_pending or 0)))

    def set_version(self, partition: str, version: int) -> int:
        """Announce the trainer's current policy version for a partition. Gets with a staleness
        bound then hand out only samples of version >= version - max_staleness; with
        retire_stale, the samples this makes too stale are deleted. Returns how many were."""
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or version < 0:
            raise DockValueError(f"version must be an int >= 0, got {version!r}")
        return self._partition_op(partition, set_version=pb.SetVersion(version=int(version))).samples

    def list(self, partition: str, consumer: str | None = None, *, where: Mapping[str, Any] | None = None,
             limit: int = 1000, start: int = 0) -> dict[str, Any]:
        """The partition's samples (written, not deleted), smallest index first, with their tags and
        policy versions, without taking them for anyone. `consumer`: only those not yet handed to
        it (what it could still get); `where`: as get's; at most `limit` from index `start` on.
        Returns {"indexes": [...], "versions": [...], "tags": {name: [...]}, "version": the
        trainer's version}."""
        if consumer is not None and (not isinstance(consumer, str) or not consumer):
            raise DockValueError(f"consumer must be a non-empty string or None, got {consumer!r}")
        for name, v in (("limit", limit), ("start", start)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise DockValueError(f"{name} must be an int >= 0, got {v!r}")
        op = pb.ListSamples(consumer=consumer or "", limit=min(int(limit), limits.MAX_SAMPLES) or 1, start=int(start))
        if where:
            op.where.extend(_where_list(where))
        r = self._partition_op(partition, list=op)
        tags = {t.name: list(t.values) for t in r.tags}
        idx = list(r.indexes)
        return {"indexes": idx, "versions": tags.get("version", [0] * len(idx)), "tags": tags, "version": r.version}

    def ping(self) -> float:
        """Seconds of one round trip to the controller (a hello it answers at once); raises
        DockConnectionError when it cannot be reached."""
        frame = pb.Frame(hello=pb.Hello(client=self._name, protocol=wire.PROTOCOL_VERSION))
        t0 = time.perf_counter()
        self._router.controller(lambda pool: call_on(pool, frame, timeout=self.connect_timeout),
                                deadline=time.monotonic() + self.connect_timeout)
        return time.perf_counter() - t0

    def delete(self, partition: str, indexes: Sequence[int]) -> int:
        """Delete samples: all their columns are freed on every warehouse, and no consumer gets
        them again (gets waiting for them stop waiting). Deleting a group's samples drops the group
        (DAPO-style filtering). Returns how many were not deleted before."""
        idx = _int_list("indexes", indexes)
        return self._partition_op(partition, delete=pb.DeleteSamples(indexes=idx)).samples

    def seal(self, partition: str) -> None:
        """No new samples from now on (columns of existing ones can still be written). Gets that
        can no longer be met then take what is left, and raise DockDrained when nothing is: the
        end of a stream (see dockd.data.StreamingDataset)."""
        self._partition_op(partition, seal=True)

    def reserve(self, partition: str, count: int, *, group_size: int = 1) -> list[int]:
        """Hand out `count` new sample indexes ahead of writing them (a rollout fills them later with
        put(..., indexes=...)); a multiple of `group_size`. Gets see them once their columns are put."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise DockValueError(f"count must be a positive int, got {count!r}")
        return list(self._partition_op(partition, reserve=pb.ReserveSamples(count=count, group_size=group_size)).indexes)

    def set_tags(self, partition: str, indexes: Sequence[int], tags: Mapping[str, int | Sequence[int]]) -> None:
        """Set integer tags of samples (one value for all, or one per sample), e.g. to age the
        samples a partial rollout left unfinished: ``dock.set_tags("p", idx, {"age": 1})``."""
        idx = _int_list("indexes", indexes)
        if not tags:
            raise DockValueError("tags is empty; give e.g. {'age': 1}")
        self._partition_op(partition, set_tags=pb.SetTags(indexes=idx, tags=_tag_list(tags, len(idx))))

    def save(self, partition: str, path: str | os.PathLike) -> dict[str, int]:
        """Checkpoint a partition into directory `path`: its data, indexes, groups, tags, options and
        consumer progress. Each warehouse writes the samples it holds to its own Arrow IPC file
        (`warehouse-<id>.arrow`), in parallel, and the controller writes the metadata
        (`partition.msgpack`): nothing funnels through this client. `path` must be reachable by
        every daemon of the dock under the same name (one host, or a shared filesystem).
        Samples leased but not confirmed count as not taken. Puts made while a save runs may or
        may not be in it. Returns {"samples": ..., "bytes": ...}."""
        path = _abs_dir(path)
        r = self._partition_op(partition, save=pb.SavePartition(path=path))
        return {"samples": r.samples, "bytes": r.nbytes}

    def load(self, path: str | os.PathLike, *, partition: str) -> dict[str, int]:
        """Restore a partition saved with `save` as `partition` (which must not exist). Each file
        is loaded by the warehouse of the same id when it is live, else by another one.
        Returns {"samples": ..., "bytes": ...}."""
        path = _abs_dir(path)
        r = self._partition_op(partition, load=pb.LoadPartition(path=path))
        return {"samples": r.samples, "bytes": r.nbytes}

    def stats(self, *, traffic: bool = False) -> dict[str, Any]:
        """The dock as its controller sees it: samples per partition, per consumer how many it
        has taken, holds under lease, could take now (`ready`, for the columns it asked for)
        and how many of its gets wait; per partition `depth`: per consumer the samples written,
        not deleted and not yet handed to it (any columns); asynchronous RL's `version`,
        `pending`, `stale` and options (docs/rl.md); bytes per warehouse.

        With `traffic=True` each live warehouse is also asked (one round trip each) for its
        version and its byte counters since it started (`put_bytes`, `get_bytes`); one that
        does not answer gets an `error` instead.
        """
        reply, _, _ = self._ctrl_call(pb.Frame(stats=pb.StatsRequest()))
        s = reply.stats_reply
        parts = {
            p.name: {
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
            }
            for p in s.partitions
        }
        whs = {
            w.id: {"address": f"{w.host}:{w.port}", "alive": w.alive, "state": w.state or "joined",
                   "capacity": w.capacity, "bytes": w.used}
            for w in s.warehouses
        }
        if traffic:
            self._router.learn(s.warehouses)
            for wid, w in whs.items():
                if not w["alive"]:
                    continue
                try:
                    hello = self._router.hello(wid, timeout=min(self.connect_timeout, STATS_HELLO_TIMEOUT_S))
                except DockError as e:
                    w["error"] = str(e)
                    continue
                w.update(version=hello.version, put_bytes=hello.put_bytes, get_bytes=hello.get_bytes,
                         device_bytes=hello.device_used, device_capacity=hello.device_capacity,
                         metadata_bytes=hello.metadata, freed_bytes=hello.freed, reclaimable_bytes=hello.reclaimable)
        return {
            "version": s.version,
            "controller": self._router.address,
            "samples": sum(p["samples"] for p in parts.values()),
            "bytes": sum(w["bytes"] for w in whs.values()),
            "waiting": s.waiting,
            "partitions": parts,
            "warehouses": whs,
        }

    def _pool_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dockd-fetch")
        return self._executor

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every connection; calls blocked in other threads wake with DockClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._send_confirms(self._take_confirms(), retry=False)
        except DockError as e:
            logger.warning("[client] could not confirm fetched leases while closing: %s", e)
        self._finalizer()
        self._links.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Dock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError(
            "a dockd.Dock holds live connections and cannot be pickled; pass its address "
            f"({self.address!r}) to the worker and call dockd.connect(address) there"
        )

    def __repr__(self) -> str:
        return f"Dock(address={self.address!r}, home_warehouse={self.home}, closed={self._closed})"


def _flush_loop(ref: weakref.ref, wake: threading.Event, stop: threading.Event) -> None:
    """The confirm flusher of one Dock; holds it only weakly so a dropped Dock can be collected."""
    while not stop.is_set():
        wake.wait()
        wake.clear()
        stop.wait(_CONFIRM_DELAY)  # gather the confirms of a burst of gets
        dock = ref()
        if dock is None:
            return
        try:
            dock._send_confirms(dock._take_confirms())  # reconnects if the controller restarted
        except DockError as e:  # gone for good, or closing: unconfirmed leases expire and are handed out again
            logger.warning("[client] could not confirm fetched leases: %s", e)
        dock._send_unpins()
        del dock


def _finalize(stop: threading.Event, wake: threading.Event, router: Router) -> None:
    stop.set()
    wake.set()
    router.close()


def decode_reply(columns: Sequence[pb.ColumnData], body: np.ndarray, fds: list[int], pins: Sequence[int] = (),
                 unpin: Callable[[int], None] | None = None, *, lazy: bool = False, shared=(),
                 received: dict | None = None, device=None) -> list[Any]:
    """Values of a reply: views of its body, or of shared-memory segments mapped copy-on-write.

    Each segment is mapped once (the range its runs span) and its descriptor
    closed; the tensors keep the mapping, and so the memory, alive. When the
    mapping goes, the segment is unpinned (`pins` names the passed segments), so
    the warehouse may fill it again; one that was passed but not mapped is
    unpinned at once."""
    buffers: dict[int, tuple[Any, int]] = {0: (body, 0)}
    mapped: set[int] = set()
    try:
        if fds:
            for k, (lo, hi) in codec.spans(columns, "segment").items():
                if not 0 < k <= len(fds):
                    raise DockProtocolError(f"a run refers to descriptor {k} of {len(fds)} passed")
                sid = pins[k - 1] if k <= len(pins) else 0
                on_free = functools.partial(unpin, sid) if unpin is not None and sid else None
                mm, delta = shm.map_private(fds[k - 1], lo, hi, on_free=on_free)
                buffers[k] = (mm, lo - delta)
                mapped.add(k)
    finally:
        for fd in fds:
            os.close(fd)
        if unpin is not None:
            for k, sid in enumerate(pins, 1):
                if k not in mapped:
                    unpin(sid)
    if shared:
        buffers.update(_copy_shared(columns, shared, device))
    if received:  # device buffers that came over a device link
        buffers.update(received)
    try:
        if lazy:
            return [codec.Runs.of(c, buffers) for c in columns]
        return [codec.decode_column(c, buffers) for c in columns]
    except KeyError as e:
        raise DockProtocolError(f"a run refers to descriptor {e} that was not passed") from None


def _seconds(timeout: Any, what: str = "timeout") -> float | None:
    """A timeout as seconds (None, or infinity: no limit); refuses what is not a number >= 0."""
    import math

    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise DockTypeError(f"{what} is a number of seconds or None, got {timeout!r}")
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise DockValueError(f"{what} must be >= 0 seconds or None (no limit), got {timeout!r}")
    return None if t > limits.MAX_TIMEOUT else t  # (infinity, or past a year: no limit)


def _check_partition(partition: str) -> None:
    if not isinstance(partition, str) or not partition:
        raise DockValueError(f"partition must be a non-empty string such as 'step-0', got {partition!r}")
    _text(partition, "partition name")


def _text(name: str, what: str) -> None:
    """Names travel as UTF-8: a string with a lone surrogate (from bytes decoded with
    surrogateescape, or a bad slice of an emoji) has no UTF-8 form."""
    try:
        name.encode()
    except UnicodeEncodeError:
        raise DockValueError(f"{what} {name!r} is not valid text (it holds a lone surrogate); names are UTF-8 "
                             "strings") from None


def _int_list(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, (str, bytes)):
        raise DockTypeError(f"{name} must be a sequence of ints")
    try:
        arr = np.asarray(values)
    except Exception:
        raise DockTypeError(f"{name} must be a sequence of ints") from None
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise DockTypeError(f"{name} must be a flat sequence of ints, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64).tolist()


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _tag_list(tags: Mapping[str, Any], n: int) -> list[pb.Tag]:
    if not isinstance(tags, Mapping):
        raise DockTypeError(f"tags must be a dict of tag name -> int or list of ints, got {type(tags).__name__}")
    out = []
    for name, v in tags.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise DockValueError(f"a tag name is an identifier such as 'age', got {name!r}")
        values = [v] if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else _int_list(f"tag {name!r}", v)
        if len(values) not in (1, n):
            raise DockValueError(f"tag {name!r} has {len(values)} values for {n} samples; give one, or one per sample")
        out.append(pb.Tag(name=name, values=[int(x) for x in values]))
    return out


def _where_list(where: Mapping[str, Any]) -> list[pb.TagRange]:
    if not isinstance(where, Mapping):
        raise DockTypeError(f"where must be a dict of tag name -> value or (lo, hi), got {type(where).__name__}")
    out = []
    for name, rng in where.items():
        if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
            lo = hi = int(rng)
        elif isinstance(rng, (tuple, list)) and len(rng) == 2:
            lo = _INT64[0] if rng[0] is None else int(rng[0])
            hi = _INT64[1] if rng[1] is None else int(rng[1])
        else:
            raise DockTypeError(f"where[{name!r}] must be an int or a (lo, hi) pair (None: open end), got {rng!r}")
        if lo > hi:
            raise DockValueError(f"where[{name!r}] = {rng!r} matches nothing: give lo <= hi")
        out.append(pb.TagRange(name=name, lo=lo, hi=hi))
    return out


def _rank_fields(req: pb.AcquireRequest, dp_rank, dp_size, mp_group, step, balance_by) -> None:
    """Fill an acquire's rank-aware fields (see Dock.get)."""
    def whole(name, v, lo):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise DockValueError(f"{name} must be an int >= {lo}, got {v!r}")
        return int(v)

    if dp_size is None and dp_rank is not None:
        raise DockValueError("dp_rank needs dp_size (the number of data-parallel ranks)")
    if dp_size is None and mp_group is None:
        if step is not None or balance_by:
            raise DockValueError("step and balance_by belong to rank-aware gets: pass dp_rank and dp_size "
                                 "(or mp_group)")
        return
    if dp_size is not None:
        req.dp_size = whole("dp_size", dp_size, 1)
        if dp_rank is None:
            if mp_group is None:
                raise DockValueError("a rank-aware get needs dp_rank (this rank, 0..dp_size-1) with dp_size")
            dp_rank = mp_group[0]
        req.dp_rank = whole("dp_rank", dp_rank, 0)
        if req.dp_rank >= req.dp_size:
            raise DockValueError(f"dp_rank must be below dp_size={req.dp_size}, got {req.dp_rank}")
    else:
        req.dp_size, req.dp_rank = 1, 0
    if mp_group is not None:
        if not isinstance(mp_group, (tuple, list)) or len(mp_group) != 3:
            raise DockTypeError(f"mp_group is (group_id, rank_in_group, group_size), got {mp_group!r}")
        gid, rank, size = (whole(n, v, lo) for n, v, lo in
                           (("mp_group's group_id", mp_group[0], 0), ("mp_group's rank", mp_group[1], 0),
                            ("mp_group's size", mp_group[2], 1)))
        if rank >= size or size > 64:
            raise DockValueError(f"mp_group needs 0 <= rank_in_group < group_size <= 64, got {mp_group!r}")
        if dp_size is not None and gid != req.dp_rank:
            raise DockValueError(f"with dp_size, mp_group's group_id is the group's data-parallel rank "
                                 f"({req.dp_rank}), got {gid}")
        req.mp_rank, req.mp_size = rank, size
        if dp_size is None:
            req.mp_group = gid
    if step is not None:
        req.has_step, req.step = True, whole("step", step, 0)
    if balance_by:
        names = [balance_by] if isinstance(balance_by, str) else balance_by
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise DockTypeError(f"balance_by names tags or columns, got {balance_by!r}")
        req.balance_by.extend(names)


def _abs_dir(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise DockTypeError(f"path must be a directory name, got {path!r}")
    return os.path.abspath(os.fspath(path))


def _device(device) -> Any:
    """The torch device a get's results go to (None: leave them where they are), checked here."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DockValueError(f"device={device!r} is not a device name such as 'cuda:0': {e}") from None
    if dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        if backend is None or not backend.is_available():
            raise DockValueError(f"device={device!r}, but this process has no {dev.type} device "
                                 f"(torch.{dev.type}.is_available() is False)")
    return dev


def _keeps(t) -> bool:
    """put(device="keep"): whether a tensor stays in device memory (a CUDA or NPU tensor; a CPU tensor
    only with DOCKD_CPU_DEVICE_TIER=1, which runs the device tier's paths on machines without one)."""
    return device_share.tiered(t.device.type)


def _maps_device(target) -> bool:
    """Whether a get for `target` takes device-tier data as shared device memory (copied once, device
    to device) rather than as host bytes."""
    return target is not None and device_share.tiered(target.type)


def _on(t, dev) -> bool:
    return t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)


def _to_device(values: list[Any], dev) -> list[Any]:
    """A column's tensors on `dev`: one pinned host buffer and one copy per dtype, then views.
    Non-tensor values, and tensors already there (from the device tier), stay as they are."""
    import torch

    if dev.type == "cpu":
        return [v.to(dev) if isinstance(v, torch.Tensor) else v for v in values]
    out = list(values)
    by_dtype: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and not _on(v, dev):
            by_dtype.setdefault(v.dtype, []).append(i)
    for dtype, pos in by_dtype.items():
        sizes = [values[i].numel() for i in pos]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        torch.cat([values[i].reshape(-1) for i in pos], out=host)
        flat = host.to(dev, non_blocking=True)
        for i, part in zip(pos, torch.split(flat, sizes)):
            out[i] = part.view(values[i].shape)
    if by_dtype:
        getattr(torch, dev.type).current_stream(dev).synchronize()  # (the pinned buffers may go now)
    return out


def _copy_shared(columns: Sequence[pb.ColumnData], shared: Sequence[pb.DeviceBuffer], device) -> dict[int, tuple]:
    """Device-tier bytes a fetch reply shares (warehouse memory): each buffer's span that the runs
    use, copied once onto `device` and unmapped at once. Keys as codec.buffer_key gives them."""
    import torch

    out: dict[int, tuple] = {}
    copies = []
    for k, (lo, hi) in codec.spans(columns, "device_buffer").items():
        if not 0 < k <= len(shared):
            raise DockProtocolError(f"a run refers to device buffer {k} of {len(shared)} shared")
        src = device_share.open_buffer(shared[k - 1])
        if hi > src.numel():
            raise DockProtocolError(f"device runs end at byte {hi} of a {src.numel()}-byte device buffer")
        dst = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        dst.copy_(src[lo:hi])
        copies.append(dst)
        out[-k] = (dst, lo)
        del src
    for dst in copies:
        device_share.synchronize(dst)
    return out
