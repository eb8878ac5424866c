"""TransferQueue's metadata types on dockd: `KVBatchMeta` (the KV API's) and `BatchMeta` (the client's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class KVBatchMeta:
    """Same fields as ``transfer_queue.KVBatchMeta``."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have same length, but got {len(self.keys)} and {len(self.tags)}")
        if len(self.keys) != len(set(self.keys)):
            raise ValueError("Got duplicated keys.")

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class BatchMeta:
    """Metadata of a batch of samples (the low-level ``transfer_queue.BatchMeta`` surface).

    Same constructor as TransferQueue's: ``global_indexes`` and ``partition_ids`` are
    required (``BatchMeta()`` raises TypeError, as in TransferQueue; `BatchMeta.empty()`
    builds an empty one). On dockd a global index is the sample's index in the dock
    partition holding the TQ partition's data; ``_custom_backend_meta`` carries each
    sample's key (``"_key"``).
    """

    def __init__(
        self,
        global_indexes: list[int],
        partition_ids: list[str],
        field_schema: dict[str, dict[str, Any]] | None = None,
        production_status: Any = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: list[dict[str, Any]] | None = None,
        _custom_backend_meta: list[dict[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(
                f"Length mismatch: global_indexes has {len(self.global_indexes)}, "
                f"partition_ids has {len(self.partition_ids)}"
            )
        n = len(self.global_indexes)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        self.production_status = (
            np.array(production_status, dtype=np.int8) if production_status is not None else np.zeros(n, np.int8)
        )
        self.extra_info = dict(extra_info or {})
        self.custom_meta = [dict(d) for d in custom_meta] if custom_meta else [{} for _ in range(n)]
        self._custom_backend_meta = (
            [dict(d) for d in _custom_backend_meta] if _custom_backend_meta else [{} for _ in range(n)]
        )
        for name, what in (("production_status", self.production_status), ("custom_meta", self.custom_meta),
                           ("_custom_backend_meta", self._custom_backend_meta)):
            if len(what) != n:
                raise ValueError(f"{name} length {len(what)} != batch_size {n}")

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls(global_indexes=[], partition_ids=[], extra_info=extra_info)

    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    @property
    def keys(self) -> list[str]:
        """The TQ keys of the samples (dockd extension)."""
        return [m.get("_key") for m in self._custom_backend_meta]  # type: ignore[misc]

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        out = self.copy()
        out.field_schema = {f: dict(self.field_schema[f]) for f in field_names if f in self.field_schema}
        return out

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        return BatchMeta(
            [self.global_indexes[i] for i in sample_indices],
            [self.partition_ids[i] for i in sample_indices],
            self.field_schema,
            self.production_status[list(sample_indices)],
            self.extra_info,
            [self.custom_meta[i] for i in sample_indices],
            [self._custom_backend_meta[i] for i in sample_indices],
        )

    def chunk(self, chunks: int) -> list[BatchMeta]:
        bounds = np.linspace(0, self.size, chunks + 1).astype(int)
        return [self.select_samples(list(range(bounds[i], bounds[i + 1]))) for i in range(chunks)]

    def copy(self) -> BatchMeta:
        return self.select_samples(list(range(self.size)))

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return [dict(d) for d in self.custom_meta]

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        """Merge one dict per sample into ``custom_meta`` (`DockTQClient.set_custom_meta` stores it)."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"The length of custom_meta list {len(custom_meta)} must match the batch size: {self.size}"
            )
        for mine, new in zip(self.custom_meta, custom_meta):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One BatchMeta per partition, in order of first appearance."""
        pids = list(dict.fromkeys(self.partition_ids))
        return [self.select_samples([i for i, p in enumerate(self.partition_ids) if p == pid]) for pid in pids]

    def __repr__(self) -> str:
        return (f"BatchMeta(size={self.size}, partition_ids={sorted(set(self.partition_ids))}, "
                f"fields={self.field_names}, extra_info={self.extra_info})")
