"""Sharing tensor memory between processes of one node: the device tier's transport.

`export(t)` describes the storage under a tensor as a `DeviceBuffer` message;
`open_buffer(desc)` maps it in another process as a flat uint8 tensor on the
same device. Nothing is pickled: the message carries the handle fields and
the receiver rebuilds the storage with classes of its own choosing.

- **cuda**: CUDA IPC, field by field as `torch.multiprocessing` shares CUDA
  tensors (`_share_cuda_` / `rebuild_cuda_tensor`), with torch's reference
  counting: memory a reader still maps is not reused by its producer.
- **npu**: the same on Ascend NPUs through torch_npu's IPC (`_share_npu_` /
  `torch_npu.multiprocessing.reductions.rebuild_npu_tensor`, the same eight
  fields; torch_npu 7.2 or newer, CANN 8.3 or newer). NPU storages in a private
  format (NZ and the like) cannot be shared: `base_layout` casts them to ND first.
- **cpu**: torch's file-system shared memory (`_share_filename_cpu_` /
  `_new_shared_filename_cpu`). It stands in for a device on machines without
  one, so that the device tier's paths (put, copy-in, spill, fetch, free) run
  in tests; on a GPU or NPU node the device tier holds device memory.

A mapping is read-write on every backend (CUDA IPC has no read-only mode):
the dockd client copies out of a mapping and drops it at once, and the
warehouse copies a writer's buffer into memory of its own before it answers
the put.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from dockd import config
from dockd._lazy import lazy_torch
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockValueError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals())

IPC = ("cuda", "npu")  # accelerators whose memory is shared by IPC handle
TYPES = (*IPC, "cpu")
_NPU_BASE_FORMATS = (0, 1, 2, 30)  # ACL_FORMAT_NCHW, NHWC, ND, NCDHW: the formats torch_npu can share
_ND = 2
# what torch's file-system sharing names look like; anything else is refused before it is opened
_CPU_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_CPU_MANAGER = re.compile(rb"/[\w./-]*torch-shm-dir-\w+/manager\.sock")


def cpu_stand_in() -> bool:
    """DOCKD_CPU_DEVICE_TIER=1: CPU tensors stand in for device memory (clients put them with
    device="keep" through the device tier; warehouses accept such buffers). For tests and
    machines without an accelerator; otherwise a warehouse refuses cpu buffers."""
    return config.env("DOCKD_CPU_DEVICE_TIER") not in ("", "0")


def tiered(device_type: str) -> bool:
    """Whether memory on this kind of device goes through the device tier: an accelerator's
    (cuda, npu), or a CPU tensor only with DOCKD_CPU_DEVICE_TIER=1."""
    return device_type in IPC or (device_type == "cpu" and cpu_stand_in())


def base_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` in a layout whose storage can be shared: NPU tensors in a private format are cast to ND
    (a copy); everything else as it is."""
    if t.device.type == "npu":
        import torch_npu

        if torch_npu.get_npu_format(t) not in _NPU_BASE_FORMATS:
            return torch_npu.npu_format_cast(t, _ND)
    return t


def export(t: torch.Tensor) -> tuple[pb.DeviceBuffer, int]:
    """Share the storage under `t` (moved into shared memory first for a cpu tensor that is
    not shared yet): the message, and where `t`'s first byte is in the storage."""
    st = t.untyped_storage()
    base = int(t.storage_offset()) * t.element_size()  # an int outside tracing; the stub says int | SymInt
    kind = t.device.type
    if kind in IPC:
        device, handle, size, offset, rc, rc_off, event, event_sync = getattr(st, f"_share_{kind}_")()
        desc = pb.DeviceBuffer(type=kind, device=int(device), handle=handle or b"", storage_size=int(size),
                               storage_offset=int(offset), ref_counter=rc or b"", ref_counter_offset=int(rc_off),
                               event=event or b"", event_sync=bool(event_sync), nbytes=int(size),
                               uuid=device_uuid(kind, int(device)))
    elif kind == "cpu":
        manager, name, size = st._share_filename_cpu_()
        desc = pb.DeviceBuffer(type="cpu", handle=name, manager=manager, storage_size=int(size), nbytes=int(size))
    else:
        raise DockValueError(f"tensors on {kind} cannot be shared through the device tier "
                             f"(supported: {', '.join(TYPES)})")
    return desc, base


def open_buffer(desc: pb.DeviceBuffer) -> torch.Tensor:
    """The shared storage as a flat uint8 tensor of `desc.nbytes` bytes, on its device."""
    if desc.nbytes > desc.storage_size:
        raise DockValueError(f"a device buffer of {desc.nbytes} bytes in a storage of {desc.storage_size}")
    if desc.type in IPC:
        rebuild = _rebuilder(desc.type)
        device = local_index(desc)
        # torch_npu takes the event as bytes and the flag as a bool; torch's CUDA rebuild takes None for no event
        event = desc.event if desc.type == "npu" else (desc.event or None)
        t = rebuild(torch.Tensor, (desc.storage_size,), (1,), 0, torch.UntypedStorage, torch.uint8, device,
                    desc.handle, desc.storage_size, desc.storage_offset, False, desc.ref_counter,
                    desc.ref_counter_offset, event, desc.event_sync)
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


def _rebuilder(kind: str):
    """torch's rebuild function for shared `kind` memory, once this process can map it."""
    if kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if not torch.cuda.is_available():
            raise DockValueError("a CUDA device buffer reached a process without CUDA (is it on the same node?)")
        return rebuild_cuda_tensor
    try:
        import torch_npu  # noqa: F401 - registers torch.npu
        from torch_npu.multiprocessing.reductions import rebuild_npu_tensor
    except ImportError as e:
        raise DockValueError(f"an NPU device buffer reached a process that cannot map it ({e}); NPU device tiers "
                             "need torch_npu 7.2 or newer in the warehouse and the reader") from None
    if not torch.npu.is_available():  # type: ignore[attr-defined]  # torch.npu exists once torch_npu is imported
        raise DockValueError("an NPU device buffer reached a process without a visible NPU (is it on the same node?)")
    return rebuild_npu_tensor


def _module(kind: str):
    return getattr(torch, kind)  # torch.cuda, or torch.npu once torch_npu is imported


def device_uuid(kind: str, index: int) -> str:
    """A name for the physical device behind this process's device `index`, the same in every process
    of the node whatever each one's CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES."""
    if kind == "cuda":
        return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return f"npu-{physical_npu(index)}"


def physical_npu(index: int, visible: str | None = None) -> int:
    """The physical NPU behind this process's NPU `index`: ASCEND_RT_VISIBLE_DEVICES (or `visible`)
    lists the physical ids a process sees, in the order it numbers them; unset, they are the same."""
    if visible is None:
        visible = config.env("ASCEND_RT_VISIBLE_DEVICES")
    ids = [p.strip() for p in visible.split(",") if p.strip()]
    if not ids:
        return index
    if not 0 <= index < len(ids) or not all(p.isdigit() for p in ids):
        raise DockValueError(f"NPU {index} is not in ASCEND_RT_VISIBLE_DEVICES={visible!r}")
    return int(ids[index])


def local_index(desc: pb.DeviceBuffer) -> int:
    """This process's index of the device a buffer is on (the visible-device lists may differ between processes)."""
    if not desc.uuid:
        return desc.device
    for i in range(_module(desc.type).device_count()):
        if device_uuid(desc.type, i) == desc.uuid:
            return i
    var = "CUDA_VISIBLE_DEVICES" if desc.type == "cuda" else "ASCEND_RT_VISIBLE_DEVICES"
    raise DockValueError(f"the device holding this buffer ({desc.type} {desc.uuid}) is not visible to this "
                         f"process ({var})")


def allocate(nbytes: int, like: torch.device) -> torch.Tensor:
    """Memory of this process's own on `like`'s device (shareable from the start for cpu)."""
    if like.type == "cpu":
        st = torch.UntypedStorage(max(nbytes, 1))
        st._share_filename_cpu_()
        return torch.empty(0, dtype=torch.uint8).set_(st)[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=like)


def synchronize(t: torch.Tensor) -> None:
    """Wait for copies into or out of `t` to finish (device copies are asynchronous)."""
    if t.device.type in IPC:
        _module(t.device.type).synchronize(t.device)
