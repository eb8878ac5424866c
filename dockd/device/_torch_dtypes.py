"""torch dtypes looked up by name, so that dtypes a torch build lacks are simply left out."""

from __future__ import annotations

import torch


def table(pairs: list[tuple[str, int]]) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for name, code in pairs:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            out[dt] = code
    return out
