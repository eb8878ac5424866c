"""Sharing tensor memory between processes of one node: the device tier's transport.

`export(t)` describes the storage under a tensor as a `DeviceBuffer` message;
`open_buffer(desc)` maps it in another process as a flat uint8 tensor on the
same device. Nothing is pickled: the message carries the handle fields and
the receiver rebuilds the storage with classes of its own choosing.

- **cuda**: CUDA IPC, field by field as `torch.multiprocessing` shares CUDA
  tensors (`_share_cuda_` / `rebuild_cuda_tensor`), with torch's reference
  counting: memory a reader still maps is not reused by its producer.
- **cpu**: torch's file-system shared memory (`_share_filename_cpu_` /
  `_new_shared_filename_cpu`). It stands in for a device on machines without
  one, so that the device tier's paths (put, copy-in, spill, fetch, free) run
  in tests; on a GPU node the device tier holds CUDA memory.

A mapping is read-write on both backends (CUDA IPC has no read-only mode):
the dockd client copies out of a mapping and drops it at once, and the
warehouse copies a writer's buffer into memory of its own before it answers
the put.
"""

from __future__ import annotations

import os
import re

import torch

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockValueError

TYPES = ("cuda", "cpu")
# what torch's file-system sharing names look like; anything else is refused before it is opened
_CPU_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_CPU_MANAGER = re.compile(rb"/[\w./-]*torch-shm-dir-\w+/manager\.sock")


def cpu_stand_in() -> bool:
    """DOCKD_CPU_DEVICE_TIER=1: CPU tensors stand in for device memory (clients put them with
    device="keep" through the device tier; warehouses accept such buffers). For tests and
    machines without an accelerator; otherwise a warehouse refuses cpu buffers."""
    return os.environ.get("DOCKD_CPU_DEVICE_TIER", "") not in ("", "0")


def export(t: torch.Tensor) -> tuple[pb.DeviceBuffer, int]:
    """Share the storage under `t` (moved into shared memory first for a cpu tensor that is
    not shared yet): the message, and where `t`'s first byte is in the storage."""
    st = t.untyped_storage()
    base = t.storage_offset() * t.element_size()
    if t.device.type == "cuda":
        device, handle, size, offset, rc, rc_off, event, event_sync = st._share_cuda_()
        desc = pb.DeviceBuffer(type="cuda", device=int(device), handle=handle or b"", storage_size=int(size),
                               storage_offset=int(offset), ref_counter=rc or b"", ref_counter_offset=int(rc_off),
                               event=event or b"", event_sync=bool(event_sync), nbytes=int(size),
                               uuid=_uuid(int(device)))
    elif t.device.type == "cpu":
        manager, name, size = st._share_filename_cpu_()
        desc = pb.DeviceBuffer(type="cpu", handle=name, manager=manager, storage_size=int(size), nbytes=int(size))
    else:
        raise DockValueError(f"tensors on {t.device.type} cannot be shared through the device tier yet "
                             f"(supported: {', '.join(TYPES)})")
    return desc, base


def open_buffer(desc: pb.DeviceBuffer) -> torch.Tensor:
    """The shared storage as a flat uint8 tensor of `desc.nbytes` bytes, on its device."""
    if desc.nbytes > desc.storage_size:
        raise DockValueError(f"a device buffer of {desc.nbytes} bytes in a storage of {desc.storage_size}")
    if desc.type == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if not torch.cuda.is_available():
            raise DockValueError("a CUDA device buffer reached a process without CUDA (is it on the same node?)")
        device = _local_index(desc)
        t = rebuild_cuda_tensor(torch.Tensor, (desc.storage_size,), (1,), 0, torch.UntypedStorage, torch.uint8,
                                device, desc.handle, desc.storage_size, desc.storage_offset, False,
                                desc.ref_counter, desc.ref_counter_offset, desc.event or None, desc.event_sync)
    elif desc.type == "cpu":
        if not cpu_stand_in():
            raise DockValueError("cpu device buffers are the device tier's stand-in for machines without an "
                                 "accelerator; this process accepts them only with DOCKD_CPU_DEVICE_TIER=1")
        if not _CPU_NAME.fullmatch(desc.handle) or not _CPU_MANAGER.fullmatch(desc.manager):
            raise DockValueError("a cpu device buffer must name torch shared memory (/torch_<pid>_<n>_<n>) and its "
                                 "manager socket")
        try:
            have = os.stat("/dev/shm" + desc.handle.decode()).st_size
        except OSError as e:
            raise DockValueError(f"cpu device buffer {desc.handle.decode()}: {e.strerror}") from None
        if have < desc.storage_size:  # mapping past its end would fault on the first read
            raise DockValueError(f"cpu device buffer {desc.handle.decode()} has {have} bytes, not {desc.storage_size}")
        st = torch.UntypedStorage._new_shared_filename_cpu(desc.manager, desc.handle, desc.storage_size)
        t = torch.empty(0, dtype=torch.uint8).set_(st)
    else:
        raise DockValueError(f"unknown device buffer type {desc.type!r} (known: {', '.join(TYPES)})")
    return t[: desc.nbytes]


def _uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _local_index(desc: pb.DeviceBuffer) -> int:
    """This process's index of the device a buffer is on (CUDA_VISIBLE_DEVICES may differ between processes)."""
    if not desc.uuid:
        return desc.device
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == desc.uuid:
            return i
    raise DockValueError(f"the device holding this buffer (GPU {desc.uuid}) is not visible to this process "
                         "(CUDA_VISIBLE_DEVICES)")


def allocate(nbytes: int, like: torch.device) -> torch.Tensor:
    """Memory of this process's own on `like`'s device (shareable from the start for cpu)."""
    if like.type == "cpu":
        st = torch.UntypedStorage(max(nbytes, 1))
        st._share_filename_cpu_()
        return torch.empty(0, dtype=torch.uint8).set_(st)[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=like)


def synchronize(t: torch.Tensor) -> None:
    """Wait for copies into or out of `t` to finish (CUDA copies are asynchronous)."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
