"""What a get returns: the samples' indexes and their values per column."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dockd._lazy import lazy_torch
from dockd.codec import Jagged, Runs
from dockd.codec.decode import jagged_of, offsets_of, padded_of
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
    `batch.stacked("col")`, `batch.padded("col")` and `batch.jagged("col")` build
    one tensor for a whole column without making the per-sample list first (the
    list is made on first access, then kept), `batch.packed("col")` the
    `dockd.Jagged(values, offsets)` pair; `batch.to_tensordict()` gives the whole
    batch as a tensordict.TensorDict.
    """

    __slots__ = ("partition", "indexes", "_columns", "step", "rank_weights", "_offsets")

    def __init__(self, partition: str, indexes: list[int], columns: dict[str, list[Any] | Runs], *, step: int = 0,
                 rank_weights: list[float] | None = None) -> None:
        self.partition = partition
        self.indexes = indexes
        self._columns = columns
        self.step = step  # rank-aware gets: the step this batch belongs to
        self.rank_weights = rank_weights or []  # ... with balance_by: each rank's sum of the weights
        self._offsets: dict[tuple[Any, tuple[int, ...]], torch.Tensor] = {}  # see `_offsets_of`

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
        values = self._tensors(column, "padded")
        if any(v.dim() != 1 for v in values):
            raise DockValueError(f"padded() needs 1-D values; column {column!r} has shapes {[tuple(v.shape) for v in values[:4]]}...")
        return padded_of(torch.cat(values), [len(v) for v in values], pad_value)

    def jagged(self, column: str) -> torch.Tensor:
        """A column of tensors of one dtype and trailing shape, ragged in their first dimension
        ((L_i,) or (L_i, *trailing)), as one jagged nested tensor (torch.nested, layout=torch.jagged):
        one values buffer plus offsets, in `indexes` order. The values are a view of the received
        bytes when the column came as one run (from one warehouse, and one put or consecutive puts the
        warehouse sent as one run): on the same host, of the sealed shared-memory segment, mapped
        privately (a write copies the pages it touches; the stored bytes never change); else one
        copy joins the runs. Tensors of equal shapes come back jagged too (all lengths equal)."""
        values, lengths = self._packed_rows(column, "jagged")
        return jagged_of(values, lengths, self._offsets_of(lengths, values.device))

    def packed(self, column: str) -> Jagged:
        """The column `jagged` gives, as the `dockd.Jagged(values, offsets)` pair a put takes: the values
        back to back ([rows, *trailing], a view where jagged()'s values are) and the n + 1 int64 offsets
        (sample i is values[offsets[i]:offsets[i + 1]]; varlen attention's cu_seqlens), without torch's
        nested tensor subclass, whose making and values() cost ~5x the pair's (~55 us a column, ~10). The
        offsets are shared by the batch's ragged columns of the same lengths: do not change them in place."""
        values, lengths = self._packed_rows(column, "packed")
        return Jagged(values, self._offsets_of(lengths, values.device))

    def _packed_rows(self, column: str, call: str) -> tuple[torch.Tensor, list[int]]:
        runs = self._columns.get(column)
        rows = runs.packed() if isinstance(runs, Runs) else None
        return rows if rows is not None else self._rows(column, call)

    def _offsets_of(self, lengths: list[int], device: Any) -> torch.Tensor:
        """One offsets tensor for every ragged column of this batch with these lengths (a response's
        log-probs, mask and ids): jagged nested tensors over the same offsets share their ragged
        dimension, so torch combines them (`a - b`), where separately made offsets are refused."""
        key = (device, tuple(lengths))
        out = self._offsets.get(key)
        if out is None:
            out = self._offsets[key] = offsets_of(lengths, device)
        return out

    def _rows(self, column: str, call: str) -> tuple[torch.Tensor, list[int]]:
        """A column of tensors ragged in their first dimension only, joined (a copy), and their lengths."""
        values = self._tensors(column, call)
        if any(v.dim() == 0 for v in values) or len({tuple(v.shape[1:]) for v in values}) > 1:
            raise DockValueError(f"{call}() needs values ragged in their first dimension only; column {column!r} has "
                                 f"shapes {[tuple(v.shape) for v in values[:4]]}...")
        return torch.cat(values), [v.shape[0] for v in values]

    def _tensors(self, column: str, call: str) -> list[torch.Tensor]:
        """A column's values, checked to be tensors of one dtype (for `call`)."""
        values = self[column]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise DockTypeError(f"column {column!r} holds non-tensor values; {call}() needs tensors")
        if len({v.dtype for v in values}) > 1:
            raise DockValueError(f"column {column!r} mixes dtypes {sorted({str(v.dtype) for v in values})}")
        return values

    def to_tensordict(self):
        """The batch as a tensordict.TensorDict of batch_size [n], rows in `indexes` order: a column of
        equal-shaped tensors as one [n, ...] tensor, a ragged one as a jagged nested tensor, any other as
        a NonTensorStack of its values. Needs the tensordict package (from a checkout:
        pip install -e '.[tensordict]')."""
        from dockd.client.tensordicts import to_tensordict

        return to_tensordict(self)

    def __repr__(self) -> str:
        return f"Batch(partition={self.partition!r}, samples={len(self)}, columns={self.columns})"
