"""What a get returns: the samples' indexes and their values per column."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dockd._lazy import lazy_torch
from dockd.codec import Runs
from dockd.errors import DockTypeError, DockValueError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals())


class Batch:
    """Samples handed to one consumer.

    `batch.indexes` lists the sample indexes; `batch["col"]` is a list with one
    value per sample in the same order (tensors for tensor columns, Python
    values for msgpack columns). `len(batch)` is the number of samples.
    `batch.stacked("col")` and `batch.padded("col")` build one tensor for a
    whole column without making the per-sample list first (the list is made
    on first access, then kept).
    """

    __slots__ = ("partition", "indexes", "_columns", "step", "rank_weights")

    def __init__(self, partition: str, indexes: list[int], columns: dict[str, list[Any] | Runs], *, step: int = 0,
                 rank_weights: list[float] | None = None) -> None:
        self.partition = partition
        self.indexes = indexes
        self._columns = columns
        self.step = step  # rank-aware gets: the step this batch belongs to
        self.rank_weights = rank_weights or []  # ... with balance_by: each rank's sum of the weights

    def __getitem__(self, column: str) -> list[Any]:
        try:
            values = self._columns[column]
        except KeyError:
            raise KeyError(f"column {column!r} is not in this batch; it has {list(self._columns)}") from None
        if isinstance(values, Runs):
            values = self._columns[column] = values.values()
        return values

    def stacked(self, column: str) -> torch.Tensor:
        """A column of equal-shaped tensors as one [n, *shape] tensor (zero-copy where it can be).
        A ragged column (values of different lengths) is refused: `padded` pads it."""
        runs = self._columns.get(column)
        if isinstance(runs, Runs) and (out := runs.stacked()) is not None:
            return out
        values = self[column]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise DockTypeError(f"column {column!r} holds non-tensor values; stacked() needs tensors")
        shapes = list(dict.fromkeys(tuple(v.shape) for v in values))
        if len(shapes) > 1:
            raise DockValueError(
                f"column {column!r} is ragged (shapes {shapes[:4]}{'...' if len(shapes) > 4 else ''}), and stacked() "
                f"needs one shape: batch.padded({column!r}) gives it right-padded to the longest, with the lengths")
        if len({v.dtype for v in values}) > 1:
            raise DockValueError(f"column {column!r} mixes dtypes {sorted({str(v.dtype) for v in values})}")
        return torch.stack(values)

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
        return ((c, self[c]) for c in self._columns)

    def to_dict(self) -> dict[str, list[Any]]:
        return {c: self[c] for c in self._columns}

    def padded(self, column: str, pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A 1-D ragged column as one [n, max_len] tensor plus the int64 lengths."""
        runs = self._columns.get(column)
        if isinstance(runs, Runs):
            out = runs.padded(pad_value)
            if out is not None and out[0].dim() == 2:
                return out
        values = self[column]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise DockTypeError(f"column {column!r} holds non-tensor values; padded() needs tensors")
        if any(v.dim() != 1 for v in values):
            raise DockValueError(f"padded() needs 1-D values; column {column!r} has shapes {[tuple(v.shape) for v in values[:4]]}...")
        if len({v.dtype for v in values}) > 1:
            raise DockValueError(f"column {column!r} mixes dtypes {sorted({str(v.dtype) for v in values})}")
        lengths = torch.tensor([len(v) for v in values], dtype=torch.int64)
        dtype = values[0].dtype if values else torch.float32
        padded = torch.full((len(values), int(lengths.max()) if len(values) else 0), pad_value, dtype=dtype)
        for row, v in zip(padded, values):
            row[: len(v)] = v
        return padded, lengths

    def __repr__(self) -> str:
        return f"Batch(partition={self.partition!r}, samples={len(self)}, columns={self.columns})"
