"""TransferQueue's key-value API on dockd: ``kv_put`` ... ``kv_clear`` and their ``async_`` twins.

Each call runs on the process's connection (`runtime._get`); an ``async_`` twin runs its call in
a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from dockd.trainer_plugins.verl.tq.meta import KVBatchMeta
from dockd.trainer_plugins.verl.tq.runtime import _get


def _keys(keys: list[str] | str) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    if isinstance(fields, dict):
        fields = {k: (v.unsqueeze(0) if isinstance(v, torch.Tensor) else [v]) for k, v in fields.items()}
    return _get().put([key], partition_id, fields, [tag] if tag is not None else None, data_parser)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    return _get().put(_keys(keys), partition_id, fields, tags, data_parser)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> Any:
    sel = [select_fields] if isinstance(select_fields, str) else select_fields
    return _get().get(_keys(keys), partition_id, sel)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    if select_fields is None:
        select_fields = meta.fields
    return kv_batch_get(meta.keys, meta.partition_id or "", select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return _get().list_keys(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    _get().clear(_keys(keys), partition_id)


async def async_kv_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, *args, **kwargs)


async def async_kv_batch_put(*args: Any, **kwargs: Any) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, *args, **kwargs)


async def async_kv_batch_get(*args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(kv_batch_get, *args, **kwargs)


async def async_kv_batch_get_by_meta(*args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(kv_batch_get_by_meta, *args, **kwargs)


async def async_kv_list(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    return await asyncio.to_thread(kv_list, *args, **kwargs)


async def async_kv_clear(*args: Any, **kwargs: Any) -> None:
    return await asyncio.to_thread(kv_clear, *args, **kwargs)
