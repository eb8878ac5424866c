"""A msgpack codec for the structured per-sample values plugins carry.

Framework objects hold values the dock's own msgpack path does not cover:
tuples, numpy scalars and arrays (also ``dtype=object`` arrays), tensors nested
inside dicts or lists. `encode` turns such a value into a 1-D uint8 tensor
(so it travels as a plain tensor column) and `decode` rebuilds it bit-exactly.
Nothing is pickled: every type is an explicit msgpack extension.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_OBJARRAY = 3
_EXT_TUPLE = 4
_EXT_NPSCALAR = 5

_TORCH_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"cannot encode a tensor of dtype {obj.dtype}; supported: {sorted(_TORCH_DTYPES)}")
        return msgpack.ExtType(_EXT_TENSOR, _pack([name, list(obj.shape), _tensor_bytes(obj)]))
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return msgpack.ExtType(_EXT_OBJARRAY, _pack([list(obj.shape), list(obj.reshape(-1))]))
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise TypeError(f"cannot encode a numpy array of structured dtype {obj.dtype}")
        return msgpack.ExtType(
            _EXT_NDARRAY, _pack([obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()])
        )
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_EXT_NPSCALAR, _pack([obj.dtype.str, obj.tobytes()]))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, dict):  # subclasses (OrderedDict, ...) travel as plain dicts
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, bool):  # subclasses such as IntEnum travel as their base type
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, bytes):
        return bytes(obj)
    raise TypeError(
        f"cannot encode a value of type {type(obj).__name__}: plugins carry tensors, numpy arrays and "
        "msgpack types (str, bytes, int, float, bool, None, lists, tuples, dicts) only"
    )


def _pack(obj: Any) -> bytes:
    # tuples must reach `_default`, so msgpack must not turn them into lists itself
    raw: bytes = msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)
    return raw


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        name, shape, raw = _unpack(data)
        dtype = _TORCH_DTYPES[name]
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if code == _EXT_NDARRAY:
        dt, shape, raw = _unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape).copy()
    if code == _EXT_OBJARRAY:
        shape, items = _unpack(data)
        arr = np.empty(len(items), dtype=object)
        for i, item in enumerate(items):
            arr[i] = item
        return arr.reshape(shape)
    if code == _EXT_NPSCALAR:
        dt, raw = _unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dt))[0]
    if code == _EXT_TUPLE:
        return tuple(_unpack(data))
    raise ValueError(f"unknown extension type {code} in a plugin value; was it written by a newer dockd?")


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(value: Any) -> torch.Tensor:
    """Encode `value` as a 1-D uint8 tensor."""
    raw = _pack(value)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode(blob: torch.Tensor | bytes) -> Any:
    """Inverse of `encode`."""
    if isinstance(blob, torch.Tensor):
        blob = blob.contiguous().numpy().tobytes()
    return _unpack(blob)
