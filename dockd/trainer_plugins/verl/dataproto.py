"""verl ``DataProto`` <-> dock, bit-exact.

Layout in the dock, per sample:

    batch key ``k`` (TensorDict entry)        -> tensor column ``k``
    non_tensor_batch key ``k`` (numpy array)  -> column ``"nt/k"``: the sample's element,
                                                msgpack-encoded as a uint8 tensor (in a 1-D
                                                object array, an element that is itself a numpy
                                                array or scalar is stored inside a 0-d object
                                                array, so that reads can tell it from a row of
                                                a numeric array)
    meta_info (one dict per put)              -> column ``"verl/meta_info"``

so other consumers of the same partition (a MindSpeed-style stage, an OpenRLHF
buffer, a plain `dock.get`) read the tensor columns by their verl names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dockd.client.batch import Batch
from dockd.client.tensordicts import tensor_field
from dockd.trainer_plugins import _codec, require

if TYPE_CHECKING:  # pragma: no cover
    from verl import DataProto

logger = logging.getLogger(__name__)

NON_TENSOR_PREFIX = "nt/"
META_COLUMN = "verl/meta_info"


def _verl_protocol() -> Any:
    return require("verl.protocol", extra="verl", what="dockd.trainer_plugins.verl")


def _tensordict() -> Any:
    return require("tensordict", extra="verl", what="dockd.trainer_plugins.verl")


def put_data_proto(
    dock: Any,
    data: DataProto,
    *,
    partition: str,
    indexes: Sequence[int] | None = None,
    group_size: int = 1,
    with_meta_info: bool = True,
    **put_kwargs: Any,
) -> list[int]:
    """Put every sample of `data` into `partition`; returns the sample indexes.

    With `indexes`, the columns are added to existing samples (e.g. a stage writing
    ``old_log_probs`` next to the ``responses`` it read); otherwise new samples are
    created (``group_size`` consecutive samples form one GRPO group).
    """
    n = len(data)
    if n == 0:
        raise ValueError("put_data_proto got an empty DataProto; there is nothing to put")
    if indexes is not None and len(indexes) != n:
        raise ValueError(f"put_data_proto: {len(indexes)} indexes for a DataProto of {n} samples")
    columns: dict[str, Any] = {}
    if data.batch is not None:
        if len(data.batch.batch_size) != 1:
            raise ValueError(f"put_data_proto supports one batch dimension, got batch_size={data.batch.batch_size}")
        for key, value in data.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"put_data_proto: batch[{key!r}] is a {type(value).__name__}; nested TensorDicts are not "
                    "supported, flatten them first (TensorDict.flatten_keys())"
                )
            if value.is_nested:  # as it is: a jagged one is one ragged run over its values buffer
                columns[key] = value.detach()
            else:
                columns[key] = value.detach().to("cpu")
    for key, arr in (data.non_tensor_batch or {}).items():
        if not isinstance(arr, np.ndarray) or arr.shape[:1] != (n,):
            raise ValueError(f"put_data_proto: non_tensor_batch[{key!r}] must be a numpy array with {n} rows")
        if arr.dtype == object and arr.ndim == 1:
            columns[NON_TENSOR_PREFIX + key] = [_codec.encode(_wrap_element(arr[i])) for i in range(n)]
        else:
            columns[NON_TENSOR_PREFIX + key] = [_codec.encode(arr[i]) for i in range(n)]
    if with_meta_info:
        blob = _codec.encode(dict(data.meta_info or {}))
        columns[META_COLUMN] = [blob] * n
    if indexes is not None:
        return list(dock.put(columns, partition=partition, indexes=list(indexes), **put_kwargs))
    return list(dock.put(columns, partition=partition, group_size=group_size, **put_kwargs))


def batch_to_data_proto(
    batch: Any,
    *,
    batch_keys: Sequence[str],
    non_tensor_batch_keys: Sequence[str] = (),
    with_meta_info: bool = True,
) -> DataProto:
    """Build a ``DataProto`` from a `dockd.Batch` fetched with `data_proto_columns`."""
    protocol = _verl_protocol()
    tensordict = _tensordict()
    n = len(batch.indexes)
    tensors: dict[str, torch.Tensor] = {}
    for key in batch_keys:
        tensors[key] = _batch_tensor(batch, key, n)
    non_tensors: dict[str, np.ndarray] = {}
    for key in non_tensor_batch_keys:
        items = [_codec.decode(v) for v in batch[NON_TENSOR_PREFIX + key]]
        non_tensors[key] = _stack_rows(items)
    meta_info: dict[str, Any] = {}
    if with_meta_info:
        seen: list[bytes] = []
        conflicts: set[str] = set()
        for blob in batch[META_COLUMN]:
            raw = blob.numpy().tobytes()
            if raw in seen:
                continue
            seen.append(raw)
            for k, v in _codec.decode(raw).items():
                if k in meta_info and meta_info[k] != v:
                    conflicts.add(k)
                meta_info.setdefault(k, v)
        if conflicts:
            logger.warning(
                "[verl] batch spans %d puts whose meta_info disagree on keys=%s; kept the first put's values",
                len(seen),
                sorted(conflicts),
            )
    td = tensordict.TensorDict(tensors, batch_size=[n]) if tensors else None
    data: DataProto = protocol.DataProto(batch=td, non_tensor_batch=non_tensors, meta_info=meta_info)
    return data


def _batch_tensor(batch: Any, key: str, n: int) -> torch.Tensor:
    """A batch key's column as one tensor: [n, ...] when every sample has one shape, else a jagged
    nested tensor. From a `dockd.Batch`, built from the received buffers (`Batch.stacked` / `Batch.jagged`:
    a view where the column came as one run, else one copy), no tensor per value."""
    if not n:
        return torch.empty(0)
    field = tensor_field(batch, key) if isinstance(batch, Batch) else None
    if field is None:
        values = batch[key]
        if len({tuple(v.shape) for v in values}) == 1:
            return torch.stack(values)
        return torch.nested.nested_tensor(values, layout=torch.jagged)
    if field.is_nested:  # put ragged, yet every sample of this batch has one length: [n, length, ...]
        lengths = field.offsets().diff()
        if bool((lengths == lengths[0]).all()):
            return field.values().unflatten(0, (n, int(lengths[0])))
    return field


def _wrap_element(value: Any) -> Any:
    """An element of a 1-D object array as stored: numpy arrays and scalars go inside a
    0-d object array, so `_stack_rows` keeps them as elements (not rows of a numeric array)."""
    if isinstance(value, (np.ndarray, np.generic)):
        wrapped = np.empty((), dtype=object)
        wrapped[()] = value
        return wrapped
    return value


def _is_wrapped(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 0


def _stack_rows(items: list[Any]) -> np.ndarray:
    """Rebuild a non_tensor_batch array from per-sample rows without numpy reshaping lists.

    Rows of a numeric array (numpy arrays, or numpy scalars for 1-D) are stacked back; rows of
    an n-D object array (object arrays of one shape) too; anything else, and any batch holding
    an element `_wrap_element` wrapped, becomes a 1-D object array of the elements.
    """
    if any(_is_wrapped(v) for v in items):
        items = [v[()] if _is_wrapped(v) else v for v in items]
    elif items and all(isinstance(v, np.ndarray) for v in items):
        if len({(v.dtype, v.shape) for v in items}) == 1:
            return np.stack(items)
    elif items and all(isinstance(v, np.generic) for v in items) and len({v.dtype for v in items}) == 1:
        return np.array(items, dtype=items[0].dtype)
    arr = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        arr[i] = v
    return arr


def data_proto_columns(
    batch_keys: Sequence[str], non_tensor_batch_keys: Sequence[str] = (), with_meta_info: bool = True
) -> list[str]:
    """The dock columns that hold these DataProto keys."""
    cols = list(batch_keys) + [NON_TENSOR_PREFIX + k for k in non_tensor_batch_keys]
    if with_meta_info:
        cols.append(META_COLUMN)
    return cols


def get_data_proto(
    dock: Any,
    *,
    consumer: str,
    count: int,
    partition: str,
    batch_keys: Sequence[str] = (),
    non_tensor_batch_keys: Sequence[str] = (),
    with_meta_info: bool = True,
    **get_kwargs: Any,
) -> DataProto:
    """Get `count` samples for `consumer` as a ``DataProto`` (see `get_data_proto_with_indexes`)."""
    data, _ = get_data_proto_with_indexes(
        dock,
        consumer=consumer,
        count=count,
        partition=partition,
        batch_keys=batch_keys,
        non_tensor_batch_keys=non_tensor_batch_keys,
        with_meta_info=with_meta_info,
        **get_kwargs,
    )
    return data


def get_data_proto_with_indexes(
    dock: Any,
    *,
    consumer: str,
    count: int,
    partition: str,
    batch_keys: Sequence[str] = (),
    non_tensor_batch_keys: Sequence[str] = (),
    with_meta_info: bool = True,
    **get_kwargs: Any,
) -> tuple[DataProto, list[int]]:
    """Get `count` samples for `consumer` as a ``DataProto`` plus their dock indexes.

    `get_kwargs` go to `dockd.Dock.get` (``timeout``, ``groups``, ``allow_partial``,
    ``shuffle``, ``seed``). Equal-shape tensors are stacked; ragged ones come back as a
    jagged nested tensor. Pass the indexes to `put_data_proto` to write results back.
    """
    if not batch_keys and not non_tensor_batch_keys:
        raise ValueError("get_data_proto needs at least one of batch_keys / non_tensor_batch_keys")
    cols = data_proto_columns(batch_keys, non_tensor_batch_keys, with_meta_info)
    batch = dock.get(consumer=consumer, columns=cols, count=count, partition=partition, **get_kwargs)
    data = batch_to_data_proto(
        batch, batch_keys=batch_keys, non_tensor_batch_keys=non_tensor_batch_keys, with_meta_info=with_meta_info
    )
    return data, list(batch.indexes)
