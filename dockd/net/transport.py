"""Transports: how a client carries frames and payloads to one daemon.

A `Transport` is made per daemon endpoint (the controller, each warehouse) and
lives as long as that endpoint's connection pool (`dockd.net.pool.Pool`).
Everything that differs between ways of reaching a daemon is behind it; the
put, fetch and acquire code above never asks which one it has.

Built in (best first, as `transport="auto"` tries them):

| name | module | frames | put payload | fetch payload |
|---|---|---|---|---|
| `shm` | `same_host.py` | Unix socket | staged in a sealed memfd, named | passed memfd segments, mapped copy-on-write; device-tier data by IPC handle |
| `mooncake` | `mooncake.py` | TCP | in the frame | read by the client's Mooncake Transfer Engine from the warehouse's registered segments (small runs in the frame) |
| `tcp` | `device_transport.py` | TCP | in the frame | in the frame; device-tier data over a device link (NCCL/HCCL/gloo) when the get names a device |
| `tcp` | `tcp.py` | TCP | in the frame | in the frame |

Contract (what an implementation provides; see `Transport` for signatures):

- `name`: what it is called in logs, stats and metrics (`transport="shm"`); with
  `DOCKD_TRANSPORT=<name>` only it (and the fallbacks) is tried.
- `applies(endpoint, ctx)` (classmethod): whether it can reach this daemon at all
  (same host, the daemon advertised what it needs, the library is installed).
  Cheap and without I/O. Transports with `fallback = False` are then probed
  with one connection; a failure that is not a timeout falls back to the next
  one, so a transport that cannot work here costs one failed connect once.
- `open(timeout)`: a connected, blocking socket for frames. `tls`: the CA file
  its daemons' certificates are checked with ("": none; TCP takes
  `ClientConfig.tls`); `secure(sock, timeout)`: that socket after its TLS
  handshake (`dockd.net.tls`), once the daemon's preamble said TLS follows. `describe()` names
  the daemon in errors the way the user knows it; `sniff(timeout)` may say
  what a port that sent no dockd challenge is instead (TCP asks it), and `identify(first, timeout)`
  what one that sent other bytes is (TCP asks a gRPC port whether it is a dockd daemon's admin port).
- `recv_into(sock, mv, fds)`: read what has arrived (non-blocking: raise
  BlockingIOError when nothing has), appending any passed descriptors to `fds`.
  `spin_s`: the most seconds a call polls for a reply before sleeping (the connection adapts within it).
- `put_request(put)`: the `Request` that sends one put (its `pb.PutRequest` and
  encoded body); its answer is the reply frame. `put.kept` columns are accelerator
  memory exported by handle: a transport that cannot share device memory with
  the daemon sends `put.as_host()` instead.
- `fetch_request(wid, req, device, timeout)`: the `Request` that sends one fetch;
  its answer is a `Reply` (frame, body, descriptors, and buffers it received by
  other means).
- `buffers(columns, reply, device=..., shared=...)`: every buffer the reply's
  runs point into, keyed as `dockd.codec.buffer_key` gives them (0: the body;
  k: the k-th passed segment; -k: device buffer k), as (buffer, base offset).
  It owns what the reply carried: descriptors are closed, mappings are kept
  alive by the values decoded from them. `dockd.codec.decode_reply` decodes.
- `take_unpins()`: segments of the daemon this process no longer maps, to
  report on the next request (transports that lend memory); `idle()`: work that
  can wait until a call waits for its reply (a connection runs it right after
  sending; the same-host transport unmaps there the replies whose values are
  gone); `matches(endpoint)`:
  whether it still serves the daemon a fresh hello describes (else the pool is
  dropped); `close()`.

A transport never sends anything itself: it says what to send, and what to do with the
answer, as a `Request` (frame, body buffers, descriptors, timeouts, and the `answer`,
`failed` and `then` steps), and the connection pool of its daemon sends it
(`dockd.net.pool.Pool.send`): `pool.send(pool.via.put_request(put))`.

A new transport is one module defining a `Transport` subclass (both of its ends: the
client's and, where the daemon serves it differently, the daemon's), listed in
`dockd.net.candidates.TRANSPORTS`. The Mooncake Transfer Engine transport
(`mooncake.py`) is built this way: it applies where the engine's package is installed,
sends frames over TCP (it subclasses the TCP transports), asks each fetch for the runs as
remote segments, reads them into pooled registered buffers, returned as
`Reply.received` (keys as above) from which `buffers` serves them, and names the read
in a one-way frame on the same connection (`Request.then`). `DOCKD_TRANSPORT` accepts
the names `dockd.config.ClientConfig` allows.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.config import ClientConfig

#: A daemon that answers no Hello within PROBE_S seconds is silent (stopped, hung), as the controller's
#: default --heartbeat-timeout counts it; a request waiting on one that answers waits ALIVE_EVERY_S more.
PROBE_S = ALIVE_EVERY_S = 5.0
#: A request that may wait `timeout` seconds in the daemon (for room, for samples) and has no answer
#: this many seconds after that has its daemon probed (`Pool.answers`).
ANSWER_GRACE_S = 1.0
#: A put still waiting for its answer this long after it was sent, from a warehouse that answers probes,
#: is logged once (it waits for room or for its controller, which looks like a hang from outside).
PUT_WAIT_WARN_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """A daemon as its hello (or the controller's warehouse table) describes it."""

    host: str
    port: int
    unix: str = ""                  # its same-host socket name ("": it serves none)
    warehouse: int | None = None    # its warehouse id; None for the controller's own pool
    advertised: Any = dataclasses.field(default=None, compare=False)  # the pb.WarehouseInfo or pb.HelloReply
    # that described it: where a transport finds what the daemon offers


class Daemon(Protocol):
    """A daemon as the pool that sends a request to it knows it (what a put's `alive` check asks)."""

    @property
    def address(self) -> str: ...

    def answers(self) -> bool: ...


class DeviceLinks(Protocol):
    """A client's device links to warehouses on other nodes (`dockd.net.device_transport.ReaderLinks`)."""

    def request(self, wid: int, host: str, device: Any, req: pb.FetchRequest, timeout: float | None) -> Request: ...


@dataclasses.dataclass(slots=True)
class Context:
    """What a client's transports share: its settings and a few services of the Dock."""

    config: ClientConfig = dataclasses.field(default_factory=ClientConfig)
    links: DeviceLinks | None = None                 # device links (get(device=...) from other nodes)
    device_tier: Callable[[int], bool] = lambda wid: False  # whether warehouse wid has a device tier
    wake: Callable[[], None] = lambda: None          # an unpin or idle work is queued: wake the flusher
    warned: set[str] = dataclasses.field(default_factory=set)  # one-time warnings given


@dataclasses.dataclass(slots=True)
class Put:
    """One put as encoded: the request, its body, and the columns kept in device memory (by handle)."""

    req: pb.PutRequest
    body: codec.Body
    kept: bool = False
    as_host: Callable[[], tuple[pb.PutRequest, codec.Body]] | None = None  # the same put with device columns as bytes
    answer_s: float | None = None  # seconds its answer may take before its warehouse is probed (None: no probe)
    deadline: float | None = None  # (monotonic) when to stop waiting for an answer, even from a warehouse that is there
    late: bool = False             # the deadline passed while waiting
    warned: bool = False           # its long wait was logged

    def alive(self, pool: Daemon) -> Callable[[], bool | float]:
        """For `Pool.call`: whether to keep waiting for the put's answer (its warehouse answers a probe),
        and for how long (not past the deadline). A wait past PUT_WAIT_WARN_S is logged once."""
        sent = time.monotonic()

        def check() -> bool | float:
            waited = time.monotonic() - sent
            if waited >= PUT_WAIT_WARN_S and not self.warned:
                self.warned = True
                _log.warning("[client] a put to partition %r has waited %.0fs for its answer from the warehouse at "
                             "%s, which is there: it waits for room (--capacity, or the partition's max_pending) or "
                             "for its controller; `dockd status` shows which%s", self.req.partition, waited,
                             pool.address, "" if self.deadline is not None else
                             " (a put without a timeout waits as long as that takes)")
            if self.deadline is None:
                return pool.answers()
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.late = True
                return False
            return pool.answers() and min(left, ALIVE_EVERY_S)
        return check


@dataclasses.dataclass(slots=True)
class Reply:
    """A fetch's answer: its frame, body and passed descriptors (the caller's to close, through
    `Transport.buffers`), and buffers received some other way (None: none)."""

    frame: pb.Frame
    body: np.ndarray
    fds: list[int]
    received: dict[int, tuple[Any, int]] | None = None


def _as_is(reply: Reply) -> Reply:
    return reply


def _frame(reply: Reply) -> pb.Frame:
    return reply.frame


@dataclasses.dataclass(slots=True)
class Request:
    """What a transport asks its daemon's pool to send (`Pool.send`), and what to do with the answer.

    The pool sends `frame` with `buffers` as its body (`size` bytes) and `fds` passed along, waits as
    `Pool.call` does (`timeout`, `stall`; `watch(pool)` makes its `alive` check), and returns what
    `answer` makes of the reply. A request that fails (an error reply, no answer, no connection) goes
    to `failed`, which returns the request to send instead, or None: the error is raised. Exactly one
    of `answer` and `failed` runs for each request the pool takes. `then` may name a one-way frame to
    send on the same connection once `answer` has run (or raised)."""

    frame: pb.Frame
    buffers: Sequence = ()
    size: int = 0
    fds: Sequence[int] = ()
    timeout: float | None = None
    stall: float | None = None
    watch: Callable[[Daemon], Callable[[], bool | float]] | None = None
    answer: Callable[[Reply], Any] = _as_is
    failed: Callable[[BaseException], Request | None] | None = None
    then: Callable[[pb.Frame], pb.Frame | None] | None = None


class Transport:
    """How frames and payloads reach one daemon (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    auto: ClassVar[bool] = False       # tried under transport="auto"
    fallback: ClassVar[bool] = False   # always works where it applies: used without a probe connection
    priority: ClassVar[int] = 0        # higher is tried first
    passes_fds: ClassVar[bool] = False
    spin_s: float = 0.0

    def __init__(self, endpoint: Endpoint, ctx: Context) -> None:
        self.endpoint = endpoint
        self.ctx = ctx

    @classmethod
    def applies(cls, endpoint: Endpoint, ctx: Context) -> bool:
        return True

    # -- frames --------------------------------------------------------------------------------
    def describe(self) -> str:
        return f"{self.endpoint.host}:{self.endpoint.port}"

    def open(self, timeout: float) -> socket.socket:
        raise NotImplementedError

    @property
    def tls(self) -> str:
        """The CA file this transport checks a TLS daemon's certificate with ("": it speaks no TLS)."""
        return ""

    def secure(self, sock: socket.socket, timeout: float) -> Any:
        """`sock` (as `open` made it) after the client's TLS handshake, within `timeout` seconds."""
        raise NotImplementedError

    def recv_into(self, sock: socket.socket, mv: memoryview, fds: deque[int]) -> int:
        return sock.recv_into(mv, 0, socket.MSG_DONTWAIT)

    def sniff(self, timeout: float) -> str:
        """Why the daemon is not dockd, when a connection got no challenge in time ("": unknown)."""
        return ""

    def identify(self, first: bytes, timeout: float) -> str:
        """What the port is, when a connection got `first` instead of a dockd challenge: a phrase
        such as "the gRPC admin port of a dockd daemon ..." ("": unknown)."""
        return ""

    # -- payloads ------------------------------------------------------------------------------
    def put_request(self, put: Put) -> Request:
        """Sends `put` (its answer: the reply frame)."""
        req, body = put.req, put.body
        if put.kept:  # device memory is shared by handle on one node only: send it as bytes
            assert put.as_host is not None  # encode gives every put its host-bytes form
            req, body = put.as_host()
            if "tcp-keep" not in self.ctx.warned:
                self.ctx.warned.add("tcp-keep")
                _log.warning("[client] put(device='keep') to warehouse %s over %s (not the same node, or "
                             "DOCKD_TRANSPORT=tcp): its device columns are sent and stored as host bytes",
                             self.endpoint.warehouse, self.name.upper())
        return Request(pb.Frame(put=req), body.buffers, body.size, timeout=put.answer_s, watch=put.alive, answer=_frame)

    def fetch_request(self, wid: int, req: pb.FetchRequest, device, timeout: float | None) -> Request:
        """Sends one fetch to warehouse `wid` for a get onto `device` (None: host memory); its answer: a Reply."""
        return Request(pb.Frame(fetch=req), timeout=timeout, stall=timeout)

    def buffers(self, columns: Sequence[pb.ColumnData], reply: Reply, *, device=None,
                shared: Sequence[pb.DeviceBuffer] = ()) -> dict[int, tuple[Any, int]]:
        _close_all(reply.fds)
        out: dict[int, tuple[Any, int]] = {0: (reply.body, 0)}
        if reply.received:
            out.update(reply.received)
        return out

    def decode(self, columns: Sequence[pb.ColumnData], reply: Reply, *, lazy: bool = False, device=None,
               shared: Sequence[pb.DeviceBuffer] = ()) -> list[Any]:
        """The values of `columns` from `reply` (see dockd.codec.decode_reply)."""
        return codec.decode_reply(columns, self.buffers(columns, reply, device=device, shared=shared), lazy=lazy)

    def take_unpins(self) -> list[int]:
        return []

    def idle(self) -> None:
        """Work left for when a call waits for its reply (run right after a request is sent, and by the
        flusher): nothing here."""

    def matches(self, endpoint: Endpoint) -> bool:
        """Whether this transport still serves `endpoint` as a fresh hello describes it."""
        return (endpoint.host, endpoint.port) == (self.endpoint.host, self.endpoint.port)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


_log = logging.getLogger(__name__)
@functools.lru_cache(maxsize=256)
def is_local(host: str) -> bool:
    """Whether `host` names an address of this machine (network namespace): can we bind to it?"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            if ipaddress.ip_address(addr[0]).is_loopback:
                return True
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr[0], 0))
            return True
        except (OSError, ValueError):
            continue
    return False


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


__all__ = ["Context", "Daemon", "DeviceLinks", "Endpoint", "Put", "Reply", "Request", "Transport", "is_local"]
