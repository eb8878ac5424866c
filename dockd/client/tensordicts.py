"""TensorDicts in and out (tensordict is an optional dependency: from a checkout,
`pip install -e '.[tensordict]'`).

`columns_of(td)`: a TensorDict of batch_size [n] as a put's columns: a tensor field as a batched
column, a jagged nested tensor as a jagged column (one buffer), a NonTensorStack as its n values, a
NonTensorData as its one value for every sample. `to_tensordict(batch)`: a get's Batch back as one.
"""

from __future__ import annotations

from typing import Any

from dockd._proto import dockd_pb2 as pb
from dockd.codec import Runs
from dockd.errors import DockTypeError, DockValueError


def is_tensordict(obj: Any) -> bool:
    """Whether `obj` is a tensordict collection (checked without importing tensordict)."""
    return type(obj).__module__.startswith("tensordict") and hasattr(obj, "batch_size")


def columns_of(td: Any) -> dict[str, Any]:
    """A TensorDict's fields as a put's columns (see the module's doc)."""
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    if len(td.batch_size) != 1:
        raise DockValueError(f"a TensorDict is put with batch_size [n] (one row per sample), got "
                             f"{list(td.batch_size)}; reshape it, e.g. td.reshape(-1)")
    n = int(td.batch_size[0])
    out: dict[str, Any] = {}
    for key in td.keys():  # noqa: SIM118 (iterating a TensorDict iterates its rows)
        value = td.get(key)
        if isinstance(value, NonTensorStack):
            out[key] = value.tolist()
        elif isinstance(value, NonTensorData):
            out[key] = [value.data] * n
        elif isinstance(value, TensorDictBase):
            raise DockTypeError(f"field {key!r} of the TensorDict is itself a TensorDict; columns are flat: put "
                                "td.flatten_keys('.') instead")
        else:
            out[key] = value
    return out


def to_tensordict(batch: Any) -> Any:
    """A get's batch as a TensorDict of batch_size [len(batch)] (see Batch.to_tensordict)."""
    try:
        from tensordict import NonTensorData, NonTensorStack, TensorDict
    except ImportError:
        raise DockTypeError("Batch.to_tensordict() needs the tensordict package: "
                            "pip install -e '.[tensordict]' from a checkout") from None

    fields: dict[str, Any] = {}
    for column in batch.columns:
        field = tensor_field(batch, column)
        fields[column] = field if field is not None else NonTensorStack(*[NonTensorData(v) for v in batch[column]])
    return TensorDict(fields, batch_size=[len(batch)])


def tensor_field(batch: Any, column: str) -> Any:
    """A Batch's column as one tensor field: equal-shaped tensors as one [n, ...] tensor, ragged ones (put
    jagged, or of different lengths) as a jagged nested tensor; None when its values are not tensors."""
    import torch

    runs = batch._columns[column]
    if isinstance(runs, Runs) and {r.kind for r, _, _ in runs.runs} == {pb.TENSOR}:
        ragged = any(r.shape and r.shape[0] == -1 for r, _, _ in runs.runs)
        return batch.jagged(column) if ragged else batch.stacked(column)
    values = batch[column]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    return batch.stacked(column) if len({tuple(v.shape) for v in values}) == 1 else batch.jagged(column)
