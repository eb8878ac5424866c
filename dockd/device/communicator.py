"""`Communicator`: one interface over the NCCL and HCCL bindings.

    comm = Communicator("nccl")            # or Communicator.for_device("npu:0"), Communicator.for_tensor(t)
    uid = comm.unique_id()                  # on rank 0; hand the bytes to the other ranks
    comm.init(uid, rank, world, device=0)
    comm.send(t, peer=1); comm.recv(t, peer=0)
    comm.broadcast(t, root=0); comm.all_gather(out, t)
    with comm.group():                      # fuse several sends/recvs (ncclGroupStart/End)
        ...
    comm.destroy()

Calls are enqueued on a stream (by default the current stream of the tensor's device)
and return before the transfer finishes, like the C API; synchronise the stream
(`torch.cuda.current_stream().synchronize()`) before reading results on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dockd.device.errors import DeviceArgumentError, DeviceDTypeError
from dockd.device.hccl import HcclLibrary
from dockd.device.nccl import NcclLibrary

BACKENDS = ("nccl", "hccl")
_DEVICE_BACKEND = {"cuda": "nccl", "npu": "hccl"}


def backend_for_device(device) -> str:
    """"nccl" for a CUDA device, "hccl" for an Ascend NPU; DeviceArgumentError otherwise."""
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    try:
        return _DEVICE_BACKEND[kind]
    except KeyError:
        raise DeviceArgumentError(f"no collective backend for device type {kind!r} "
                                  "(cuda -> nccl, npu -> hccl)") from None


def load_backend(name: str, library_path: str | None = None):
    """The library object of backend `name` ("nccl" or "hccl")."""
    if name == "nccl":
        return NcclLibrary(library_path)
    if name == "hccl":
        return HcclLibrary(library_path)
    raise DeviceArgumentError(f"unknown collective backend {name!r}; choose one of {', '.join(BACKENDS)}")


class Communicator:
    """One rank of a NCCL or HCCL communicator, moving torch tensors by `data_ptr()` and `numel()`."""

    def __init__(self, backend: str = "nccl", *, library_path: str | None = None) -> None:
        self.lib = load_backend(backend, library_path)
        self.backend = backend
        self.rank = -1
        self.world = 0
        self.device = None
        self._comm: int | None = None

    @classmethod
    def for_device(cls, device, *, library_path: str | None = None) -> Communicator:
        return cls(backend_for_device(device), library_path=library_path)

    @classmethod
    def for_tensor(cls, tensor, *, library_path: str | None = None) -> Communicator:
        return cls.for_device(tensor.device, library_path=library_path)

    # --- setup ------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self._comm is not None

    @property
    def handle(self) -> int:
        """The raw ncclComm_t / HcclComm pointer value."""
        if self._comm is None:
            raise DeviceArgumentError(f"{self.backend} communicator is not initialised (call init first)")
        return self._comm

    def unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes) / HcclRootInfo (4108 bytes); made on one rank, shared with all."""
        return self.lib.get_unique_id()

    def init(self, unique_id: bytes, rank: int, world: int, *, device=None) -> Communicator:
        """Join the communicator as `rank` of `world`; blocks until every rank has joined.

        `device` (an index or torch.device) is made current first; without it the current device is used.
        """
        if self._comm is not None:
            raise DeviceArgumentError("communicator already initialised; destroy it first")
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise DeviceArgumentError(f"rank {rank!r} is not in [0, world={world!r})")
        if device is not None:
            self.lib.set_device(device)
            self.device = device
        self._comm = self.lib.comm_init_rank(bytes(unique_id), rank, world)
        self.rank, self.world = rank, world
        return self

    def destroy(self) -> None:
        """Free the communicator (after its pending work); a no-op when not initialised."""
        comm, self._comm = self._comm, None
        if comm is not None:
            self.lib.comm_destroy(comm)

    def abort(self) -> None:
        """Abort pending work and free the communicator (ncclCommAbort; HCCL: destroy)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            self.lib.comm_abort(comm)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.destroy()
        else:
            self.abort()

    # --- transfers ----------------------------------------------------------------------------
    def _peer(self, peer: int, what: str) -> int:
        if not (isinstance(peer, int) and 0 <= peer < self.world):
            raise DeviceArgumentError(f"{what} {peer!r} is not in [0, world={self.world})")
        return peer

    def _tensor(self, tensor, what: str) -> tuple[int, int, int]:
        """(data_ptr, numel, dtype code) of a contiguous tensor on this backend's device type."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise DeviceDTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.lib.device_type:
            raise DeviceArgumentError(f"{what} is on {tensor.device}; {self.backend} moves "
                                      f"{self.lib.device_type} tensors only")
        if not tensor.is_contiguous():
            raise DeviceArgumentError(f"{what} must be contiguous (call .contiguous() first)")
        return tensor.data_ptr(), tensor.numel(), self.lib.dtype_code(tensor.dtype)

    def _stream(self, stream, tensor) -> int:
        if stream is None:
            return self.lib.current_stream(tensor.device)
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "npu_stream"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        raise DeviceArgumentError(f"stream must be None, an int handle or a torch stream, got {stream!r}")

    def send(self, tensor, peer: int, *, stream=None) -> None:
        """Send the whole tensor to rank `peer` (which posts a matching recv)."""
        ptr, n, dt = self._tensor(tensor, "tensor")
        self.lib.send(ptr, n, dt, self._peer(peer, "peer"), self.handle, self._stream(stream, tensor))

    def recv(self, tensor, peer: int, *, stream=None) -> None:
        """Receive into the whole tensor from rank `peer`."""
        ptr, n, dt = self._tensor(tensor, "tensor")
        self.lib.recv(ptr, n, dt, self._peer(peer, "peer"), self.handle, self._stream(stream, tensor))

    def broadcast(self, tensor, root: int, *, stream=None) -> None:
        """In place: every rank's tensor ends up equal to rank `root`'s."""
        ptr, n, dt = self._tensor(tensor, "tensor")
        self.lib.broadcast(ptr, n, dt, self._peer(root, "root"), self.handle, self._stream(stream, tensor))

    def all_gather(self, output, input, *, stream=None) -> None:
        """output (world * input.numel() elements) = the inputs of ranks 0..world-1, concatenated."""
        sp, sn, sdt = self._tensor(input, "input")
        rp, rn, rdt = self._tensor(output, "output")
        if input.dtype != output.dtype:
            raise DeviceArgumentError(f"input is {input.dtype} but output is {output.dtype}")
        if input.device != output.device:
            raise DeviceArgumentError(f"input is on {input.device} but output on {output.device}")
        if rn != sn * self.world:
            raise DeviceArgumentError(f"output has {rn} elements; all_gather over {self.world} ranks "
                                      f"of {sn} needs {sn * self.world}")
        self.lib.all_gather(sp, rp, sn, sdt, self.handle, self._stream(stream, input))

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Fuse the calls made inside into one launch (ncclGroupStart/End, HcclGroupStart/End).

        Needed, for instance, when a rank both sends to and receives from the same peer.
        """
        self.lib.group_start()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):   # close the group; the first error is the one to see
                self.lib.group_end()
            raise
        self.lib.group_end()

    def __repr__(self) -> str:
        state = f"rank {self.rank}/{self.world}" if self._comm is not None else "not initialised"
        return f"<Communicator {self.backend} {state} lib={self.lib.path}>"
