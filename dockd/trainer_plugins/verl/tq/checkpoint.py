"""``save_checkpoint`` / ``load_checkpoint``: every TQ partition's key log and data through
`dockd.Dock.save` / ``load`` (`store._Client.save` / ``load``), in a directory replaced atomically."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from dockd.trainer_plugins.verl.tq import FACADE
from dockd.trainer_plugins.verl.tq.runtime import _get

logger = logging.getLogger(FACADE)


_METADATA_FILE = "metadata.json"


def save_checkpoint(
    checkpoint_dir: str | os.PathLike,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Save every TQ partition (keys, tags, fields, data, consumer progress) into `checkpoint_dir`.

    Each TQ partition's key log and data go through `dockd.Dock.save` (each daemon writes its
    own files), plus ``metadata.json`` with `metadata` under ``"user_metadata"``. Like
    TransferQueue, the directory is replaced atomically (written as ``<dir>.tmp``, then renamed)
    and must be reachable by every dock daemon under the same name (one host, or a shared
    filesystem). dockd keeps its data in memory, so ``include_storage=False`` is ignored with a
    warning, as TransferQueue does for its in-memory SimpleStorage.
    """
    if not include_storage:
        logger.warning("[tq] include_storage=False has no effect on dockd (in-memory data); saving the data too")
    client = _get()
    final = Path(os.path.abspath(os.fspath(checkpoint_dir)))
    tmp = final.parent / f"{final.name}.tmp"
    old = final.parent / f"{final.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        saved = client.save(str(tmp))
        with open(tmp / _METADATA_FILE, "w") as f:
            json.dump({"storage_saved": True, "user_metadata": metadata or {}, "dockd_partitions": saved}, f, indent=2)
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    logger.info("[tq] checkpoint saved to %s (partitions=%s)", final, sorted(saved))


def load_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """Restore the TQ partitions saved by `save_checkpoint`, replacing partitions of the same names.

    Call it before other processes use those partitions (verl calls it when resuming): a process
    that already read a replaced partition keeps its old view of the keys.
    """
    final = Path(os.path.abspath(os.fspath(checkpoint_dir)))
    old = final.parent / f"{final.name}.old"
    if not final.exists() and old.exists():
        old.rename(final)
    if not final.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {final}")
    meta_path = final / _METADATA_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{_METADATA_FILE} not found in {final}")
    with open(meta_path) as f:
        meta = json.load(f)
    if "dockd_partitions" not in meta:
        raise ValueError(f"{final} is not a checkpoint written by dockd's transfer_queue.save_checkpoint")
    _get().load(str(final), meta["dockd_partitions"])
    logger.info("[tq] checkpoint loaded from %s", final)
