"""Swapping the update (training) weights between device and host memory.

The update weights stay the caller's tensors the whole time (optimizer and
model references remain valid).  Swapping works on their *storages*:

swap out
    copy every distinct storage into a slot of one pinned host buffer, then
    ``storage.resize_(0)``, which returns the device memory to the allocator.
swap in
    ``storage.resize_(nbytes)`` and copy the bytes back.  Views (for example
    parameters that are slices of one flat buffer) see their data again.
prefetch
    the same as swap in, issued in chunks on a side stream so that it runs
    while generation finishes; ``finish`` makes the compute stream wait for
    it.  On CPU it is a plain synchronous copy.

The host buffer is allocated once, sized to the update weights, and reused
on every cycle (the "pinned pool"); nothing else is kept on the host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from .device import DeviceInfo, _log_once
from .errors import LayoutError, ReshardStateError

__all__ = ["ByteAccountant", "HostPool", "UpdateWeightSwapper"]

logger = logging.getLogger(__name__)

_ALIGN = 512


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ByteAccountant:
    """Device bytes held by the module: current value and peak since reset."""

    __slots__ = ("current", "peak")

    def __init__(self, start: int = 0) -> None:
        self.current = start
        self.peak = start

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, nbytes: int) -> None:
        self.current -= nbytes
        assert self.current >= 0, "byte accounting went negative"

    def reset_peak(self) -> None:
        self.peak = self.current


def byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostPool:
    """One host buffer, pinned when the device has a pinned allocator."""

    def __init__(self, nbytes: int, device: DeviceInfo) -> None:
        self.pinned = False
        if device.is_accelerator:
            try:
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
            except RuntimeError as exc:
                _log_once(
                    "pin-failed",
                    logging.WARNING,
                    "[reshard] pinned host memory unavailable (%s); falling back to pageable "
                    "host memory: swaps stay correct but run slower and synchronously",
                    exc,
                )
                self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        else:
            _log_once(
                "pin-cpu",
                logging.INFO,
                "[reshard] device is cpu: the host pool uses pageable memory (pinning needs an accelerator)",
            )
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer.narrow(0, offset, nbytes)


@dataclass(slots=True)
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    host_offset: int
    names: list[str]


class UpdateWeightSwapper:
    """Moves the storages behind a set of tensors to a host pool and back."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        device: DeviceInfo,
        accountant: ByteAccountant,
        *,
        chunk_bytes: int,
    ) -> None:
        self.device = device
        self.accountant = accountant
        self.chunk_bytes = chunk_bytes
        self.slots: list[_Slot] = []
        by_ptr: dict[int, _Slot] = {}
        offset = 0
        for name, t in tensors.items():
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                raise LayoutError(f"update weight {name!r} has an empty storage (already freed?)")
            if not storage.resizable():
                raise LayoutError(
                    f"update weight {name!r} has a non-resizable storage (created from numpy, "
                    "shared memory or a DLPack capsule?); clone it into a regular torch tensor"
                )
            slot = by_ptr.get(storage.data_ptr())
            if slot is None:
                slot = _Slot(storage, storage.nbytes(), offset, [name])
                by_ptr[storage.data_ptr()] = slot
                self.slots.append(slot)
                offset += _align(slot.nbytes)
            else:
                slot.names.append(name)
        self._tensors = tensors
        self._slot_of = {name: slot for slot in self.slots for name in slot.names}
        self.total_bytes = sum(s.nbytes for s in self.slots)
        self.pool_bytes = offset
        self.pool: HostPool | None = None
        self.resident = True
        self._event: Any = None
        self._stream: Any = None

    def check_unchanged(self) -> None:
        """Raise if a caller re-pointed an update tensor at new memory (for
        example ``param.data = other``) since construction: in-place updates
        are fine, new storages would be missed by the swap."""
        for name, t in self._tensors.items():
            slot = self._slot_of[name]
            if t.untyped_storage().data_ptr() != slot.storage.data_ptr() or (
                t.untyped_storage().nbytes() != slot.nbytes
            ):
                raise LayoutError(
                    f"update weight {name!r} now lives in a different storage than when AllGatherSwap "
                    "was built; update weights in place (param.data.copy_(...)) or build a new AllGatherSwap"
                )

    def ensure_pool(self) -> HostPool:
        if self.pool is None:
            self.pool = HostPool(self.pool_bytes, self.device)
        return self.pool

    @property
    def pinned(self) -> bool:
        return self.pool is not None and self.pool.pinned

    @property
    def prefetching(self) -> bool:
        return self._event is not None

    def swap_out(self) -> int:
        """Copy every storage to the host pool and free its device memory."""
        if not self.resident:
            raise ReshardStateError("update weights are already swapped out")
        pool = self.ensure_pool()
        dev = self.device.torch_device
        for slot in self.slots:
            pool.view(slot.host_offset, slot.nbytes).copy_(
                byte_view(slot.storage, dev), non_blocking=pool.pinned
            )
        # The host copies must be complete before the memory is handed back;
        # on accelerators frees are stream-ordered, this sync is for the host.
        self.device.synchronize()
        for slot in self.slots:
            slot.storage.resize_(0)
            self.accountant.free(slot.nbytes)
        self.resident = False
        return self.total_bytes

    def _allocate(self) -> None:
        for slot in self.slots:
            slot.storage.resize_(slot.nbytes)
            self.accountant.alloc(slot.nbytes)

    def _copy_in(self) -> None:
        assert self.pool is not None
        dev = self.device.torch_device
        for slot in self.slots:
            dst = byte_view(slot.storage, dev)
            src = self.pool.view(slot.host_offset, slot.nbytes)
            for start in range(0, slot.nbytes, self.chunk_bytes):
                n = min(self.chunk_bytes, slot.nbytes - start)
                dst.narrow(0, start, n).copy_(src.narrow(0, start, n), non_blocking=self.pool.pinned)

    def swap_in(self) -> int:
        """Reallocate the storages and copy the bytes back (blocking)."""
        if self.resident:
            raise ReshardStateError("update weights are already resident")
        self._allocate()
        self._copy_in()
        self.device.synchronize()
        self.resident = True
        return self.total_bytes

    def start_prefetch(self) -> int:
        """Start the swap-in on a side stream; returns the bytes in flight.

        On CPU (or without a pinned pool) this is a blocking swap-in.
        """
        if self.resident:
            raise ReshardStateError("update weights are already resident; nothing to prefetch")
        if not (self.device.is_accelerator and self.pinned):
            return self.swap_in()
        current = self.device.current_stream()
        if self._stream is None:
            self._stream = self.device.new_stream()
        # Allocate on the compute stream, then let the side stream start only
        # after everything already queued there (including earlier frees).
        self._allocate()
        self._stream.wait_stream(current)
        with self.device.stream_context(self._stream):
            self._copy_in()
            self._event = self.device.new_event()
            self._event.record(self._stream)
        self.resident = True
        return self.total_bytes

    def finish_prefetch(self, *, block: bool = False) -> float:
        """Order the compute stream after the prefetch; returns seconds waited
        on the host when ``block`` is true (else 0)."""
        if self._event is None:
            return 0.0
        t0 = time.perf_counter()
        self.device.current_stream().wait_event(self._event)
        if block:
            self._event.synchronize()
        self._event = None
        return time.perf_counter() - t0 if block else 0.0

    def release_pool(self) -> None:
        if not self.resident:
            raise ReshardStateError("cannot release the host pool while the update weights live in it")
        self.pool = None
