"""Fields in and out of dock columns: what a put gives (a TensorDict, a dict, after a ``data_parser``)
becomes one column per field, and columns read back become a TensorDict.

A regular tensor field is one tensor column (one row per sample), a nested tensor field one ragged
column (a jagged one put as its values buffer and offsets, no tensor per sample), anything else a msgpack-encoded ``"nt/<field>"`` column.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import dockd
from dockd.client.tensordicts import tensor_field
from dockd.trainer_plugins import _codec
from dockd.trainer_plugins.verl.tq.keylog import NT


def _parse_fields(fields: Any, data_parser: Callable[[Any], Any]) -> dict[str, Any]:
    """Run a TQ ``data_parser`` on a plain dict of the fields, as TransferQueue does: a batched
    tensor per regular tensor field, a list per nested-tensor or non-tensor field."""
    plain: dict[str, Any] = {}
    nested: set[str] = set()
    for name, values in fields.items():
        if isinstance(values, torch.Tensor) and values.is_nested:
            plain[name] = list(values.unbind(0))
            nested.add(name)
        elif isinstance(values, torch.Tensor):
            plain[name] = values
        elif hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # NonTensorStack
            plain[name] = values.tolist()
        else:
            plain[name] = list(values)
    before = {k: (len(v) if isinstance(v, list) else v.shape[0]) for k, v in plain.items()}
    returned = data_parser(plain)
    if isinstance(returned, dict):
        plain = returned
    after = {k: (len(v) if isinstance(v, list) else v.shape[0]) for k, v in plain.items()}
    if before != after:
        raise ValueError(
            f"data_parser must keep the fields and their number of values; before {before}, after {after}"
        )
    for name in nested:
        if all(isinstance(v, torch.Tensor) for v in plain[name]):
            plain[name] = torch.nested.nested_tensor(plain[name], layout=torch.jagged)
    return plain


def _field_items(fields: Any, n: int) -> list[tuple[str, Any]]:
    items = list(fields.items())
    out: list[tuple[str, Any]] = []
    for name, values in items:
        if isinstance(values, torch.Tensor):
            if values.shape[0] != n:
                raise ValueError(f"field {name!r} has {values.shape[0]} rows for {n} keys")
            out.append((name, values))
        elif hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # NonTensorStack / NonTensorData
            data = values.tolist()
            out.append((name, data if isinstance(data, list) and len(data) == n else [data] * n))
        else:
            seq = list(values)
            if len(seq) != n:
                raise ValueError(f"field {name!r} has {len(seq)} values for {n} keys")
            out.append((name, seq))
    return out


def to_columns(fields: Any, n: int) -> tuple[dict[str, Any], dict[str, bool]]:
    """The dock columns of the `fields` of `n` keys, and field -> whether it is a tensor field."""
    columns: dict[str, Any] = {}
    kinds: dict[str, bool] = {}
    for name, values in _field_items(fields, n):
        if isinstance(values, torch.Tensor) and not values.is_nested:
            columns[name] = values.detach().to("cpu")
            kinds[name] = True
        elif isinstance(values, torch.Tensor):  # a nested tensor: as it is (a jagged one is one buffer in the dock)
            columns[name] = values.detach()
            kinds[name] = True
        else:
            columns[NT + name] = [_codec.encode(v) for v in values]
            kinds[name] = False
    return columns, kinds


def to_tensordict(tensordict: Any, names: list[str], cols: list[str], values: Any, n: int) -> Any:
    """A TensorDict of `n` rows with field `names` from the dock columns `cols` (one per name) in
    `values` (a dockd Batch, or a dict of lists): non-tensor columns decoded into a NonTensorStack, tensors
    of one shape stacked, ragged ones (or none at all) a jagged nested tensor, made from a Batch's received
    buffer without a tensor per value (`Batch.jagged`)."""
    out: dict[str, Any] = {}
    for f, c in zip(names, cols):
        if c.startswith(NT):
            out[f] = tensordict.NonTensorStack.from_list([_codec.decode(v) for v in values[c]])
        elif isinstance(values, dockd.Batch) and (field := tensor_field(values, c)) is not None:
            out[f] = field
        else:
            vals = values[c]
            if len({tuple(v.shape) for v in vals}) <= 1 and vals:
                out[f] = torch.stack(vals)
            else:
                out[f] = torch.nested.nested_tensor(vals, layout=torch.jagged)
    return tensordict.TensorDict(out, batch_size=[n])
