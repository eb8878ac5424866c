"""Accelerator collective bindings: NCCL (libnccl.so.2) and HCCL (libhccl.so) through ctypes.

`Communicator` is the one interface; `NcclLibrary` / `HcclLibrary` are the thin
per-library bindings under it. Nothing here imports torch.cuda or torch_npu until
a stream or device is actually needed, and no library is loaded until asked for.

The warehouse's device tier, same-node CUDA IPC reads and cross-node device links
(`dockd.net.device_link`) build on them; see docs/device.md.
"""

from dockd.device.communicator import BACKENDS, Communicator, backend_for_device, load_backend
from dockd.device.discovery import HCCL_ENV, NCCL_ENV, load_hccl_library, load_nccl_library
from dockd.device.errors import (
    CollectiveError,
    DeviceArgumentError,
    DeviceDTypeError,
    DeviceError,
    DeviceLibraryNotFound,
    DockDeviceError,
    HcclError,
    NcclError,
)
from dockd.device.hccl import HCCL_ROOT_INFO_BYTES, HcclLibrary, HcclRootInfo, hccl_dtype
from dockd.device.nccl import NCCL_UNIQUE_ID_BYTES, NcclLibrary, NcclUniqueId, nccl_dtype, own_host_env

__all__ = [
    "BACKENDS", "HCCL_ENV", "HCCL_ROOT_INFO_BYTES", "NCCL_ENV", "NCCL_UNIQUE_ID_BYTES",
    "CollectiveError", "Communicator", "DeviceArgumentError", "DeviceDTypeError", "DeviceError",
    "DeviceLibraryNotFound", "DockDeviceError", "HcclError", "HcclLibrary", "HcclRootInfo", "NcclError",
    "NcclLibrary", "NcclUniqueId", "backend_for_device", "hccl_dtype", "load_backend", "load_hccl_library",
    "load_nccl_library", "nccl_dtype", "own_host_env",
]
