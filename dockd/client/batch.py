"""What a get returns: the samples' indexes and their values per column."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dockd.errors import DockTypeError, DockValueError


class Batch:
    """Samples handed to one consumer.

    `batch.indexes` lists the sample indexes; `batch["col"]` is a list with one
    value per sample in the same order (tensors for tensor columns, Python
    values for msgpack columns). `len(batch)` is the number of samples.
    """

    __slots__ = ("partition", "indexes", "_columns")

    def __init__(self, partition: str, indexes: list[int], columns: dict[str, list[Any]]) -> None:
        self.partition = partition
        self.indexes = indexes
        self._columns = columns

    def __getitem__(self, column: str) -> list[Any]:
        try:
            return self._columns[column]
        except KeyError:
            raise KeyError(f"column {column!r} is not in this batch; it has {list(self._columns)}") from None

    def __contains__(self, column: object) -> bool:
        return column in self._columns

    def __len__(self) -> int:
        return len(self.indexes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    @property
    def columns(self) -> list[str]:
        return list(self._columns)

    def items(self):
        return self._columns.items()

    def to_dict(self) -> dict[str, list[Any]]:
        return dict(self._columns)

    def padded(self, column: str, pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A 1-D ragged column as one [n, max_len] tensor plus the int64 lengths."""
        values = self[column]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise DockTypeError(f"column {column!r} holds non-tensor values; padded() needs tensors")
        if any(v.dim() != 1 for v in values):
            raise DockValueError(f"padded() needs 1-D values; column {column!r} has shapes {[tuple(v.shape) for v in values[:4]]}...")
        if len({v.dtype for v in values}) > 1:
            raise DockValueError(f"column {column!r} mixes dtypes {sorted({str(v.dtype) for v in values})}")
        lengths = torch.tensor([len(v) for v in values], dtype=torch.int64)
        dtype = values[0].dtype if values else torch.float32
        out = torch.full((len(values), int(lengths.max()) if len(values) else 0), pad_value, dtype=dtype)
        for row, v in zip(out, values):
            row[: len(v)] = v
        return out, lengths

    def __repr__(self) -> str:
        return f"Batch(partition={self.partition!r}, samples={len(self)}, columns={self.columns})"
