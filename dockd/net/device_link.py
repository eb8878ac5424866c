"""Cross-node device reads: a two-rank collective link between a reader and a warehouse.

A reader on another node that asks for device-tier data on its accelerator
(`get(device="cuda:0")`) opens one link per warehouse and keeps it: it makes
the rendezvous (an ncclUniqueId / HcclRootInfo; for the CPU stand-in, the
address of a TCPStore it hosts), sends it with its fetch, and the warehouse
joins as the link's second rank. Every later device fetch on the link is one
request and one reply over dockd's wire (metadata only) plus one send/recv
of each device buffer's used span over the link: device to device, no host
copy.

    reader = Link.offer("nccl", torch.device("cuda:0"), host)   # reader: makes the rendezvous
    holder = Link("nccl", torch.device("cuda:1"))                # warehouse: joins with it
    holder.join(reader.rendezvous, HOLDER)  /  reader.join(reader.rendezvous, READER)
    holder.send([t1, t2])                   /  reader.recv([d1, d2])

- **nccl / hccl**: dockd's own bindings (`dockd.device.Communicator`), on a
  stream of the link's own, waited for with a deadline; on a timeout or error
  the communicator is aborted and the link is dropped (both sides).
- **gloo**: torch's gloo process group over a TCPStore the reader hosts. It
  stands in for a device link on machines without an accelerator
  (DOCKD_CPU_DEVICE_TIER=1), so that the protocol runs in tests.

A join that the other side never answers cannot be cancelled in NCCL or HCCL
(`ncclCommInitRank` blocks); it runs in a thread of its own and is abandoned
after the deadline, its resources with it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from typing import TYPE_CHECKING, Any

from dockd import config
from dockd._lazy import lazy_torch
from dockd.errors import DockConnectionError, DockError, DockTimeout, DockValueError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from dockd.device import Communicator  # (imported where it is used: its dtype tables import torch)
else:
    torch = lazy_torch(globals())

READER, HOLDER = 0, 1
BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def timeout() -> float:
    """Seconds a link's join or transfer may take (DOCKD_DEVICE_LINK_TIMEOUT, default 60)."""
    return config.env_float("DOCKD_DEVICE_LINK_TIMEOUT", 60.0)


def backend_for(device: torch.device) -> str:
    try:
        return BACKENDS[device.type]
    except KeyError:
        raise DockValueError(f"no device link for {device.type} devices (known: {', '.join(BACKENDS)})") from None


class Link:
    """One end of a two-rank link; `backend` is "nccl", "hccl" or "gloo"."""

    def __init__(self, backend: str, device: torch.device) -> None:
        if backend not in BACKENDS.values():
            raise DockValueError(f"unknown device link backend {backend!r} (known: {', '.join(BACKENDS.values())})")
        if BACKENDS.get(device.type) != backend:
            raise DockValueError(f"a {backend} link cannot move tensors on {device}")
        self.backend, self.device = backend, device
        self.rendezvous = b""
        self.joined = self.closed = False
        self._store: dist.TCPStore | None = None     # gloo
        self._pg: dist.ProcessGroupGloo | None = None  # gloo, once joined
        self._comm: Communicator | None = None       # nccl / hccl (None once closed)
        self._stream: Any = None                     # nccl / hccl, once joined: a torch.cuda / torch.npu Stream
        if backend != "gloo":
            from dockd.device import Communicator

            self._comm = Communicator(backend)  # loads the library: DeviceLibraryNotFound when it is missing

    @classmethod
    def offer(cls, backend: str, device: torch.device, host: str) -> Link:
        """The reader's end, with a fresh rendezvous (gloo: a TCPStore listening on `host`)."""
        link = cls(backend, device)
        if backend == "gloo":
            import torch.distributed as dist

            store = link._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=timeout()))
            link.rendezvous = f"{host}:{store.port}".encode()
        else:
            assert link._comm is not None  # made in __init__ for every backend but gloo
            link.rendezvous = link._comm.unique_id()
        return link

    # --- setup -------------------------------------------------------------------------------
    def join(self, rendezvous: bytes, rank: int) -> None:
        """Become rank `rank` (READER or HOLDER); returns once both ends have joined."""
        if self.closed:
            raise DockConnectionError("the device link was closed")
        if self.backend == "gloo":
            self._join_gloo(rendezvous, rank)
        else:
            comm = self._comm
            assert comm is not None  # every backend but gloo has one until the link is closed
            _bounded(lambda: comm.init(rendezvous, rank, 2, device=self.device),
                     f"joining a {self.backend} device link")
            self._stream = _module(self.device).Stream(device=self.device)
        self.joined = True

    def _join_gloo(self, rendezvous: bytes, rank: int) -> None:
        import torch.distributed as dist

        limit = datetime.timedelta(seconds=timeout())
        host, _, port = rendezvous.decode(errors="replace").rpartition(":")
        if not host or not port.isdigit():
            raise DockValueError(f"a gloo link rendezvous is host:port, got {rendezvous[:64]!r}")
        try:
            if self._store is None:
                self._store = dist.TCPStore(host, int(port), is_master=False, timeout=limit)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
            opts._timeout = limit
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host if rank == READER else local_address(host))]
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("dockd-link", self._store), rank, 2, opts)
        except RuntimeError as e:
            raise DockConnectionError(f"joining a gloo device link at {host}:{port}: {e}") from None

    # --- transfers ---------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor]) -> None:
        """Send each (contiguous) tensor to the reader, in order; returns when all have gone. Tensors
        on another device of this node are copied onto the link's device first (device to device)."""
        self._move(tensors, send=True)

    def recv(self, tensors: list[torch.Tensor]) -> None:
        """Receive into each tensor from the holder, in order; returns when all have arrived."""
        self._move(tensors, send=False)

    def _move(self, tensors: list[torch.Tensor], *, send: bool) -> None:
        if self.closed:
            raise DockConnectionError("the device link was closed")
        if not self.joined:
            raise DockValueError("the device link has not been joined yet")
        what = "sending over" if send else "receiving over"
        peer = READER if send else HOLDER
        if self.backend == "gloo":
            pg = self._pg
            assert pg is not None  # set by a gloo join
            deadline = time.monotonic() + timeout()
            # (torch's stubs give ProcessGroupGloo's Backend base no send / recv)
            works = [(pg.send if send else pg.recv)([t], peer, i)  # type: ignore[attr-defined]
                     for i, t in enumerate(tensors)]
            try:
                for w in works:
                    w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                raise DockConnectionError(f"{what} a gloo device link: {e}") from None
            return
        mod = _module(self.device)
        comm, stream = self._comm, self._stream
        assert comm is not None and stream is not None  # set by a nccl / hccl join
        with mod.device(self.device):  # the communicator's device, whichever this thread's is
            if send:  # peer copies, ordered with both devices' current streams (kept until `done`)
                tensors = [t if t.device == self.device else t.to(self.device) for t in tensors]
            stream.wait_stream(mod.current_stream(self.device))  # the tensors' producers first
            with comm.group():
                for t in tensors:
                    (comm.send if send else comm.recv)(t, peer, stream=stream)
            done = mod.Event()
            done.record(stream)
        deadline = time.monotonic() + timeout()
        while not done.query():
            if time.monotonic() > deadline:
                self.close()
                raise DockTimeout(f"{what} a {self.backend} device link took more than {timeout():g}s "
                                  "(DOCKD_DEVICE_LINK_TIMEOUT); the link was aborted")
            time.sleep(0.0005)
        if not send:  # the caller reads the results on its current stream
            mod.current_stream(self.device).wait_stream(stream)

    def close(self) -> None:
        """Abort pending work and free the link (either end; the other end then fails or times out)."""
        self.closed = True
        comm, self._comm = self._comm, None
        if comm is not None and comm.initialized:
            with contextlib.suppress(Exception):  # a failed abort leaves nothing more to free
                comm.abort()
        self._pg = self._store = None
        self.joined = False


def _bounded(fn, what: str) -> None:
    """Run `fn` in a thread of its own and wait at most timeout() for it (NCCL/HCCL joins cannot be
    cancelled: a join that times out is abandoned)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            out.append(e)

    t = threading.Thread(target=run, name="dockd-link-join", daemon=True)
    t.start()
    t.join(timeout())
    if not out:
        raise DockTimeout(f"{what}: the other end did not join within {timeout():g}s (DOCKD_DEVICE_LINK_TIMEOUT)")
    if isinstance(out[0], DockError):
        raise out[0]
    if out[0] is not None:  # e.g. a CUDA error setting the device
        raise DockConnectionError(f"{what}: {type(out[0]).__name__}: {out[0]}") from out[0]


def _module(device: torch.device):
    return getattr(torch, device.type)  # torch.cuda, or torch.npu once torch_npu is imported


def local_address(host: str) -> str:
    """This machine's address on the route to `host` (the address a gloo holder announces)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return host
