"""The synchronous client: `Dock`, a facade over the client's parts.

    put  = one data round trip to this host's warehouse (which commits the
           metadata to the controller before acknowledging)
    get  = one acquire round trip to the controller (metadata only), then one
           fetch round trip per warehouse involved, in parallel, then a
           one-way confirm

The parts: `put` (encoding and sending puts), `get` (gets and reads: a
get's `options` sent by the `acquirer`, then `fetch` from warehouses),
`confirm` (confirms, releases, unpins), `partition_calls` (the calls about
partitions and their samples: Dock's base class), `stats`, `validate`
(argument checks), `router` (where requests go) over `dockd.net`
connection pools, each with its transport.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from dockd._proto import dockd_pb2 as pb
from dockd._ray.query import home_for
from dockd.client import put as puts
from dockd.client import spread_io, validate
from dockd.client import stats as stats_
from dockd.client.acquirer import Acquirer
from dockd.client.batch import Batch
from dockd.client.confirm import Confirms
from dockd.client.fetch import Fetcher
from dockd.client.get import Getter
from dockd.client.lease import Lease
from dockd.client.options import GetOptions
from dockd.client.partition_calls import PartitionCalls
from dockd.client.router import Router
from dockd.client.scope import CallScope
from dockd.config import ClientConfig, client_transport, env
from dockd.errors import DockValueError
from dockd.net import auth, wire
from dockd.net.connection import Credentials
from dockd.net.device_transport import ReaderLinks
from dockd.net.transport import Context

logger = logging.getLogger(__name__)

__all__ = ["Dock", "Lease"]

CLOSE_CONFIRM_S = 2.0
"""Seconds a Dock collected, or left open at interpreter exit, may take to confirm what its gets returned
(a live controller takes one round trip); a controller that does not answer by then hands the samples
out again. Bounded so that a stopped controller never hangs the exit."""


class Dock(PartitionCalls):
    """A connection to a dock. Thread-safe; one per process is enough.

    Args:
        address: "host:port" of the controller (a warehouse's address works too:
            the client follows it to its controller).
        warehouse: where this client's puts go: a warehouse id or "host:port".
            Default: $DOCKD_WAREHOUSE, else a warehouse on this host (spread by
            process id when there are several), else any. Unpinned clients move
            to another live warehouse when theirs goes away; pinned ones wait for it.
        connect_timeout: seconds to wait when connecting to a daemon (also how
            long the first connection waits for a controller that is not up yet;
            an address where nothing listens is given up after 3 s, and one that
            answers as something other than dockd at once). Default
            $DOCKD_CONNECT_TIMEOUT or 10.
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
        tls: the CA file (PEM) to check the daemons' TLS certificates with, for a dock whose daemons
            run with --tls-cert: TCP connections then use TLS (default $DOCKD_TLS_CA; "": no TLS).
            A client without it reaches the daemons of its own host over their same-host socket,
            which never leaves the host and needs no TLS, and refuses TLS daemons elsewhere (or with
            transport="tcp"); one with it refuses a dock without TLS; both at once (DockAuthError).
        transport: how to read from warehouses on other hosts: "auto" (the default, or
            $DOCKD_TRANSPORT: shared memory on this host, Mooncake where the warehouse serves it and
            the package is installed, TCP otherwise), "tcp", or "mooncake" (required: a read from a
            warehouse that cannot serve it raises, naming why).
    """

    def __init__(self, address: str, *, warehouse: int | str | None = None, connect_timeout: float | None = None,
                 reconnect_timeout: float | None = None, token: str | bytes | None = None, name: str = "",
                 fetch_timeout: float | None = None, tls: str | None = None, transport: str | None = None) -> None:
        config = ClientConfig.from_env()
        if tls is not None:
            config = dataclasses.replace(config, tls=str(tls))
        if transport is not None:
            config = dataclasses.replace(config, transport=client_transport(transport))
        self.connect_timeout = validate.positive_seconds(
            "connect_timeout", connect_timeout if connect_timeout is not None else config.connect_timeout,
            env="DOCKD_CONNECT_TIMEOUT" if connect_timeout is None else "")
        self.reconnect_timeout = validate.positive_seconds(  # (inf: retry for ever)
            "reconnect_timeout", reconnect_timeout if reconnect_timeout is not None else config.reconnect_timeout,
            finite=False, env="DOCKD_RECONNECT_TIMEOUT" if reconnect_timeout is None else "")
        self.fetch_timeout = validate.positive_seconds(
            "fetch_timeout", fetch_timeout if fetch_timeout is not None else config.fetch_timeout,
            env="DOCKD_FETCH_TIMEOUT" if fetch_timeout is None else "")
        host, port = validate.split_address(address)
        self._name = name or f"pid{os.getpid()}"
        self._lock = threading.Lock()
        self._closed = False
        self._stop = FinalizerEvent()
        self._links = ReaderLinks()  # device links to warehouses on other nodes (get(device=...))
        pinned = warehouse if warehouse is not None else (config.warehouse or None)
        prefer, token = _ray_home(address, pinned, token)
        # the session owns this client's leases (over all its connections); random: nobody else can claim it
        self._creds = Credentials(key=auth.client_token(token), session=auth.client_session(), name=self._name)
        wake = FinalizerEvent()  # (set by finalizers: a mapping's release, the Dock's own)
        ctx = Context(config=config, links=self._links, wake=wake.set)
        self._router = Router(host, port, warehouse=pinned, connect_timeout=self.connect_timeout,
                              reconnect_timeout=self.reconnect_timeout, name=self._name, stop=self._stop, prefer=prefer,
                              creds=self._creds, ctx=ctx)
        self._warned = ctx.warned  # one-time warnings given
        self._confirms = Confirms(self._router, connect_timeout=self.connect_timeout, wake=wake, stop=self._stop)
        self._acquirer = Acquirer(self._router, self._confirms)
        self._fetcher = Fetcher(self._router, fetch_timeout=self.fetch_timeout)
        self._getter = Getter(self._router, self._acquirer, self._fetcher, self._confirms)
        ctx.device_tier = self._fetcher.device_tier
        # a Dock dropped without close(), or left open at interpreter exit (finalize runs then too, holding the
        # Dock only weakly), still confirms what its gets returned, stops its flusher and closes its sockets
        self._finalizer = weakref.finalize(self, _finalize, self._stop, wake, self._router, self._confirms)
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

    # -- public API ---------------------------------------------------------------------------
    def put(self, columns: Mapping[str, Any], *, partition: str, indexes: Sequence[int] | None = None,
            group_size: int = 1, timeout: float | None = None,
            tags: Mapping[str, int | Sequence[int]] | None = None, device: str | None = None,
            version: int | None = None) -> list[int]:
        """Write samples; returns their indexes. Returns once the data is stored and visible.

        `columns`: column name -> values, each a tensor/array whose first dimension is the sample axis,
        a list with one value per sample, or a ragged column as one buffer (a jagged nested tensor or a
        `dockd.Jagged(values, offsets)`, stored as one run; `Batch.jagged` gives it back); or a
        `tensordict.TensorDict` of batch_size [n] (see `Batch.to_tensordict`).

        Without `indexes`, creates new samples (a multiple of `group_size`, each
        run of `group_size` consecutive samples one group). With `indexes`, adds
        columns to existing samples (also those `reserve` handed out). `timeout`
        bounds the wait for warehouse capacity (None: wait as long as it takes),
        then DockFull. A home warehouse that answers neither the put (by its timeout + 1 s) nor a
        probe is left: the put goes to another warehouse, applied once (its token). A put with a
        timeout that is still not answered 2 x timeout + 10 s after the call (a stopped controller)
        raises DockTimeout; it was not acknowledged, and is applied once if the dock finishes it. `tags`: integer tags of these samples, such as
        ``{"age": 0}`` (one value for all, or a list with one per sample), that
        gets can filter (`where`) and order (`order_by`) by; `set_tags` changes
        them later. On a spread partition (--shards) new samples go to this client's home shard
        (dockd.client.spread_io) and `indexes` must all name one shard (index % S).

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
        spread = self._spread(partition)
        if spread is not None:  # (new samples to this client's home shard; `indexes` to the shard they name)
            return spread_io.put(self._router, self._warned, spread, columns, indexes=indexes, group_size=group_size,
                                 timeout=timeout, tags=tags, device=device, version=version)
        return puts.put(self._router, self._warned, columns, partition=partition, indexes=indexes,
                        group_size=group_size, timeout=timeout, tags=tags, device=device, version=version)

    def get(self, consumer: str, columns: Sequence[str], count: int, *, partition: str, timeout: float | None = None,
            groups: bool = False, allow_partial: bool = False, shuffle: bool = False, seed: int | None = None,
            dp_rank: int | None = None, dp_size: int | None = None, mp_group: tuple[int, int, int] | None = None,
            step: int | None = None, balance_by: str | Sequence[str] | None = None,
            where: Mapping[str, Any] | None = None, order_by: str | None = None, prefer_local: bool = False,
            device: str | Any | None = None, max_staleness: int | None = None, prefetch: int = 0,
            _scope: CallScope | None = None) -> Batch:
        """Take `count` samples ready in `columns` that `consumer` has not had yet.

        Blocks until they are ready; after `timeout` seconds raises DockTimeout
        saying how many were ready (None: wait as long as it takes). FIFO by
        index unless shuffle=True (seeded by `seed`). groups=True hands out
        whole groups only. allow_partial=True returns what is ready (at least
        one sample) instead of waiting for `count`. prefer_local=True hands out
        first the ready samples whose columns are all on this client's home
        warehouse (its own node's, by default), then the others in the usual
        order: reads stay on the node where they can, at the price of strict
        FIFO (and a scan of the partition per get); a get that waits is also
        served first from its home warehouse's new samples. Once the partition is
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

        The samples a get returns are taken for good once their confirm reaches the controller:
        with this client's next request, or from a thread of the client within milliseconds, and at
        the latest when the client goes: `close()` (within connect_timeout), the Dock collected, or
        the interpreter exiting with it still open (within CLOSE_CONFIRM_S). A process killed before
        that (SIGKILL, a crash, os._exit) has them handed out again to the next get of this consumer.

        `prefetch=n` (streaming consumers): one acquire takes up to n gets' worth (n leases of `count`),
        and the next gets with the same arguments are served from them: the controller sees one
        acquire per n gets. Each get's samples are fetched and confirmed as above; those held ahead
        are this client's until a get returns them, it closes (they are released at once), or half
        their lease timeout passed (released). Other clients of the consumer see at most n x count
        fewer samples meanwhile. A get that is not partial takes ahead only what is ready when it
        asks. Rank-aware gets (dp_size, mp_group) take no leases ahead. A spread partition (--shards): one
        shard serves a get, asked in turn, FIFO within a shard (dockd.client.spread_io); no rank-aware gets.
        """
        opts = GetOptions(consumer=consumer, columns=columns, count=count, partition=partition, timeout=timeout,
                          groups=groups, allow_partial=allow_partial, shuffle=shuffle, seed=seed, dp_rank=dp_rank,
                          dp_size=dp_size, mp_group=mp_group, step=step, balance_by=balance_by, where=where,
                          order_by=order_by, prefer_local=prefer_local, max_staleness=max_staleness)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise DockValueError(f"prefetch must be an int >= 0 (gets' worth of leases taken ahead), got {prefetch!r}")
        return self._getter.get(opts, device, _scope, prefetch, self._spread(partition))

    def acquire(self, consumer: str, columns: Sequence[str], count: int, *, partition: str, timeout: float | None = None,
                groups: bool = False, allow_partial: bool = False, shuffle: bool = False, seed: int | None = None,
                inline: bool = True, lease_timeout: float | None = None, dp_rank: int | None = None,
                dp_size: int | None = None, mp_group: tuple[int, int, int] | None = None, step: int | None = None,
                balance_by: str | Sequence[str] | None = None, where: Mapping[str, Any] | None = None,
                order_by: str | None = None, prefer_local: bool = False, max_staleness: int | None = None) -> Lease:
        """Low-level: lease samples without fetching them (see get).

        With inline=True (the default) the values held by the controller's own
        warehouse come back with the lease (`lease.inline`), saving their fetch.
        inline=False returns metadata only, with a location for every column:
        use it to hand the lease to other processes that fetch for themselves.
        lease_timeout: seconds this lease stays with this client before its
        samples return to the pool (default: the daemon's --lease-timeout), for
        consumers that work on leased samples for long. A lease always returns
        when its client dies; `extend` moves the deadline later. The rank-aware
        and tag arguments are get's. On a spread partition (--shards) the lease is the serving shard's, as
        it is (`lease.partition` the shard's name, `lease.indexes` the shard's own), so fetch, confirm,
        extend and release take it unchanged."""
        opts = GetOptions(
            consumer=consumer, columns=columns, count=count, partition=partition, timeout=timeout, groups=groups,
            allow_partial=allow_partial, shuffle=shuffle, seed=seed, inline=inline, lease_timeout=lease_timeout,
            dp_rank=dp_rank, dp_size=dp_size, mp_group=mp_group, step=step, balance_by=balance_by, where=where,
            order_by=order_by, prefer_local=prefer_local, max_staleness=max_staleness)
        spread = self._spread(partition)
        if spread is not None:
            first = spread_io.home_shard(self._router, spread.count)
            return spread_io.take(spread, opts, first, self._acquirer.acquire)[1]
        return self._acquirer.acquire(opts)

    @overload
    def fetch(self, lease: Lease, *, timeout: float | None = None,
              batch: Literal[False] = False) -> dict[str, list[Any]]: ...

    @overload
    def fetch(self, lease: Lease, *, timeout: float | None = None, batch: Literal[True]) -> Batch: ...

    def fetch(self, lease: Lease, *, timeout: float | None = None, batch: bool = False) -> dict[str, list[Any]] | Batch:
        """Low-level: read a lease's values from the warehouses holding them, in parallel: a list per
        column, or with batch=True a `Batch` of the lease's samples, whose columns that came whole from
        one warehouse stay the received buffers (`Batch.jagged` / `Batch.stacked` without a tensor
        per value). A warehouse that does not answer within `timeout` seconds (default
        `fetch_timeout`) raises DockTimeout naming it; the lease is left as it is (release it, or
        fetch again)."""
        timeout = validate.seconds(timeout)
        limit = self.fetch_timeout if timeout is None else timeout
        values = self._fetcher.fetch(lease, lazy=batch, deadline=time.monotonic() + limit)
        return Batch(lease.partition, lease.indexes, values) if batch else values

    def read(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> Batch:
        """Read written samples by index without taking them for any consumer.

        Raises DockNotFound when an index does not exist or a column is not
        written for it yet (read never waits)."""
        return self._getter.read(partition, indexes, columns)

    def confirm(self, lease: Lease) -> None:
        """Low-level: the lease's samples were fetched; they are taken for good.

        Raises DockLeaseError if the lease expired or was released first (its samples
        were handed out again), or belongs to another client and `lease.ticket` is missing.
        A lease whose partition was cleared meanwhile confirms quietly (nothing was handed out)."""
        self._confirms.confirm(lease)

    def extend(self, lease: Lease, seconds: float | None = None) -> float:
        """Low-level: keep a lease `seconds` longer from now (default: the dock's lease timeout);
        returns the seconds it now has. DockLeaseError if it already expired or is another client's."""
        if seconds is not None and not seconds > 0:
            raise DockValueError(f"seconds must be > 0, got {seconds}")
        req = pb.ExtendRequest(lease=lease.id, ticket=lease.ticket, seconds=seconds or 0.0)
        reply, _, _ = self._ctrl_call(pb.Frame(extend=req), at=lease.controller)
        return reply.extend_reply.seconds

    def release(self, lease: Lease) -> int:
        """Low-level: give a lease's samples back to the pool for this consumer."""
        return self._confirms.release(lease)

    def ping(self) -> float:
        """Seconds of one round trip to the controller (a hello it answers at once); raises
        DockConnectionError when it cannot be reached."""
        frame = pb.Frame(hello=pb.Hello(client=self._name, protocol=wire.PROTOCOL_VERSION))
        t0 = time.perf_counter()
        self._router.controller(lambda pool: pool.call(frame, timeout=self.connect_timeout),
                                deadline=time.monotonic() + self.connect_timeout)
        return time.perf_counter() - t0

    # -- model weights (dockd.weights) ---------------------------------------------------------------
    def publish_weights(self, named_tensors: Any, *, model: str = "default", version: int | None = None,
                        bucket_size: int = 32 << 20, keep: int = 2, hold: float = 120.0,
                        timeout: float | None = None, dtype: Any = None) -> Any:
        """Publish a version of a model's weights: (name, tensor) pairs packed into buckets of at most
        `bucket_size` bytes and put to this client's warehouse; readers see the version only once
        every bucket is stored. `version`: default the newest + 1. The newest `keep` versions are
        kept, older ones retired once every registered reader finished them or `hold` seconds after
        their publication. `dtype`: floating tensors are cast to it first. Returns a
        `dockd.weights.Published`. See docs/weights.md."""
        from dockd.weights import publish

        return publish(self, named_tensors, model=model, version=version, bucket_size=bucket_size, keep=keep,
                       hold=hold, timeout=timeout, dtype=dtype)

    def weights_reader(self, model: str = "default", *, name: str | None = None) -> Any:
        """A registered reader of a model's weight versions (`dockd.weights.WeightsReader`): its `read()`
        yields (name, tensor) of a complete version. See docs/weights.md."""
        from dockd.weights import WeightsReader

        return WeightsReader(self, model, name=name)

    def stats(self, *, traffic: bool = False) -> dict[str, Any]:
        """The dock as its controller sees it: samples per partition, per consumer how many it
        has taken, holds under lease, could take now (`ready`, for the columns it asked for)
        and how many of its gets wait; per partition `depth`: per consumer the samples written,
        not deleted and not yet handed to it (any columns); asynchronous RL's `version`,
        `pending`, `stale` and options, and with max_pending `pending_by`: per consumer puts
        wait for, the samples it has yet to take, the most first (docs/rl.md); bytes per warehouse.

        With `traffic=True` each live warehouse is also asked (one round trip each) for its
        version and its byte counters since it started (`put_bytes`, `get_bytes`); one that
        does not answer gets an `error` instead.
        """
        replies = {addr: self._ctrl_call(pb.Frame(stats=pb.StatsRequest()), at=addr)[0].stats_reply
                   for addr in self._router.controllers or [self._router.address]}
        return stats_.stats(replies, self._router, traffic=traffic, connect_timeout=self.connect_timeout)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Confirm what this client's gets returned (within connect_timeout), then close every
        connection; calls blocked in other threads wake with DockClosed. A Dock that is collected,
        or still open at interpreter exit, confirms them too (within CLOSE_CONFIRM_S)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._confirms.close(self.connect_timeout)
        self._finalizer()
        self._links.close()
        self._fetcher.close()

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


def _ray_home(address: str, pinned, token):
    """Inside Ray, for a dock dockd.ray launched: this Ray node's warehouse ("host:port", to prefer as
    home) and the dock's token (unless one is given or set in the environment)."""
    if "ray" not in sys.modules or (pinned and token is not None):
        return None, token
    prefer, ray_token = home_for(address)
    if token is None and not env("DOCKD_TOKEN") and not env("DOCKD_TOKEN_FILE"):
        token = ray_token
    return prefer, token


class FinalizerEvent(threading.Event):
    """A threading.Event that finalizers may set. A finalizer runs inside whatever allocation its thread
    makes, one inside this Event's own `set` included (`Condition.notify` allocates under the lock): with
    the plain lock of threading.Event the thread would wait there on itself. This lock is reentrant."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(threading.RLock())


def _finalize(stop: threading.Event, wake: threading.Event, router: Router, confirms: Confirms) -> None:
    """A Dock closed, collected, or still open at interpreter exit (its threads are still running
    then; the event loop of an AsyncDock may be gone, and is not needed). Its confirms go first."""
    confirms.close(CLOSE_CONFIRM_S)
    stop.set()
    wake.set()
    router.close()
