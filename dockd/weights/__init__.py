"""Versioned model weights in the dock: a trainer publishes versions, readers read them.

    published = dock.publish_weights(model.named_parameters(), model="policy", version=step)
    reader = dock.weights_reader("policy")
    for name, tensor in reader.read():          # the newest complete version
        ...

The pure parts: `buckets` (bucket plans), `versions` (the version table's names and its
retirement rule). The client side: `publish` (`Publication`), `read` (`WeightsReader`), `table`
(the table's partitions through the ordinary client calls). See docs/weights.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from dockd.weights.publish import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_HOLD_S,
    DEFAULT_KEEP,
    Publication,
    Published,
    Publisher,
    Settings,
)
from dockd.weights.read import WeightsReader

if TYPE_CHECKING:
    import torch

    from dockd.client.interface import DockInterface as Dock

__all__ = ["DEFAULT_BUCKET_SIZE", "DEFAULT_HOLD_S", "DEFAULT_KEEP", "Publication", "Published", "Publisher",
           "Settings", "WeightsReader", "publish"]


def publish(dock: Dock, named_tensors: Iterable[tuple[str, torch.Tensor]], *, model: str = "default",
            version: int | None = None, bucket_size: int = DEFAULT_BUCKET_SIZE, keep: int = DEFAULT_KEEP,
            hold: float = DEFAULT_HOLD_S, timeout: float | None = None,
            dtype: torch.dtype | None = None, fanout: int = 1) -> Published:
    """Publish one version (see `Dock.publish_weights`; `fanout`: warehouses each holder of the version
    relays it to, 1 for a chain)."""
    pub = Publication(dock, model=model, version=version, bucket_size=bucket_size, keep=keep, hold=hold,
                      timeout=timeout, dtype=dtype, fanout=fanout)
    pub.add_all(named_tensors)
    return pub.finish()
