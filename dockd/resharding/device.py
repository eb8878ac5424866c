"""Device and collective-backend detection.

The module never hard-codes a device: the device is the one the update
weights live on, and it must match the ``torch.distributed`` backend

======  ===========  ===================================
device  backend      runtime
======  ===========  ===================================
cpu     gloo         plain host memory, no streams
cuda    nccl         ``torch.cuda`` streams and events
npu     hccl         ``torch_npu`` (``torch.npu``) streams
======  ===========  ===================================

:func:`detect_device` probes what the machine offers (NPU, then CUDA, then
CPU) for callers that have not placed their weights yet.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import BackendError

__all__ = ["DeviceInfo", "detect_device", "device_of"]

logger = logging.getLogger(__name__)

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_logged: set[str] = set()


def _log_once(key: str, level: int, msg: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install must not break CPU users
        _log_once("npu-import", logging.WARNING, "[reshard] torch_npu import failed: %s", exc)
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The device the module works on and the runtime helpers for it."""

    type: str
    """``"cpu"``, ``"cuda"`` or ``"npu"``."""
    index: int | None = None

    @property
    def backend(self) -> str:
        """The ``torch.distributed`` backend that serves this device."""
        return _BACKENDS[self.type]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)

    @property
    def is_accelerator(self) -> bool:
        return self.type != "cpu"

    def _module(self) -> Any:
        return getattr(torch, self.type)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._module().synchronize(self.torch_device)

    def new_stream(self) -> Any:
        """A side stream on this device (``None`` on CPU)."""
        if not self.is_accelerator:
            return None
        return self._module().Stream(device=self.torch_device)

    def current_stream(self) -> Any:
        if not self.is_accelerator:
            return None
        return self._module().current_stream(self.torch_device)

    def stream_context(self, stream: Any) -> Any:
        return self._module().stream(stream)

    def new_event(self) -> Any:
        return self._module().Event()

    def memory_allocated(self) -> int:
        """Bytes the device allocator has handed out (0 on CPU)."""
        if not self.is_accelerator:
            return 0
        return int(self._module().memory_allocated(self.torch_device))

    def check_backend(self) -> None:
        """Raise :class:`BackendError` unless the default process group can
        move tensors of this device."""
        if not dist.is_available() or not dist.is_initialized():
            raise BackendError(
                "torch.distributed is not initialised; call "
                f"torch.distributed.init_process_group({self.backend!r}, ...) before building "
                "AllGatherSwap"
            )
        backend = str(dist.get_backend()).lower()
        if self.backend not in backend:
            raise BackendError(
                f"weights are on {self.type} but the process group backend is {backend!r}; "
                f"{self.type} tensors need the {self.backend!r} backend "
                f"(init_process_group({self.backend!r}) or a combined 'cpu:gloo,{self.type}:{self.backend}')"
            )


def detect_device() -> DeviceInfo:
    """The best device this process can use: NPU, then CUDA, then CPU."""
    if _npu_available():
        info = DeviceInfo("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    elif torch.cuda.is_available():
        info = DeviceInfo("cuda", torch.cuda.current_device())
    else:
        info = DeviceInfo("cpu")
    _log_once("detect", logging.INFO, "[reshard] device=%s backend=%s", info.type, info.backend)
    return info


def device_of(tensors: list[torch.Tensor]) -> DeviceInfo:
    """The single device all ``tensors`` live on; raises if they are spread."""
    devices = {t.device for t in tensors}
    if not devices:
        return detect_device()
    if len(devices) > 1:
        raise BackendError(
            f"update weights are spread over devices {sorted(map(str, devices))}; "
            "move every shard of this rank to one device"
        )
    dev = devices.pop()
    if dev.type not in _BACKENDS:
        raise BackendError(f"unsupported device type {dev.type!r}; expected one of {sorted(_BACKENDS)}")
    return DeviceInfo(dev.type, dev.index)
