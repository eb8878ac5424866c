"""Delta versions: a tensor as the difference to the same tensor of the previous version (pure).

Of a trainer step's update only a small share of low-precision values change (a bf16 value moves
only when the update crosses half a unit of its last place). A tensor of a delta version is one of

    same     bit for bit as in the base version: nothing is sent
    sparse   the flat positions whose bits changed (int32; int64 past 2**31 elements) and their new
             values: 4 + itemsize bytes per changed value, when that is less than the tensor
    dense    the tensor itself (a new tensor, another shape or dtype, or too many changes)

Values are compared by their bits (so -0.0 against 0.0, or NaNs, count as changes) and the new
values are sent, not differences: the reader rebuilds every tensor bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from dockd.errors import DockValueError
from dockd.weights.buckets import raw_bytes

SAME, SPARSE, DENSE = "same", "sparse", "dense"
IDX, VAL = "\x00i", "\x00v"  # (the names of a sparse tensor's two parts: name + IDX, name + VAL)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as integers of its size (rows of bytes for other sizes), flat."""
    raw = raw_bytes(t)
    item = t.element_size()
    dt = _INTS.get(item)
    return raw.view(dt) if dt is not None else raw.view(-1, item)


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat positions where `new`'s bits differ from `old`'s (same shape and dtype)."""
    a, b = _bits(new), _bits(old)
    ne = a != b
    if ne.dim() == 2:
        ne = ne.any(dim=1)
    return ne.nonzero().reshape(-1)


def encode(name: str, new: torch.Tensor, old: torch.Tensor | None) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """One tensor of a delta version against its base `old` (None: not in the base): its kind and the
    (name, tensor) parts to publish for it."""
    new = new.detach()
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return DENSE, [(name, new)]
    pos = changed(new.cpu(), old.cpu())
    k, n = int(pos.numel()), new.numel()
    if k == 0:
        return SAME, []
    idx = pos.to(torch.int32 if n < 2**31 else torch.int64)
    if k * (idx.element_size() + new.element_size()) >= n * new.element_size():
        return DENSE, [(name, new)]
    return SPARSE, [(name + IDX, idx), (name + VAL, new.cpu().reshape(-1)[pos])]


def decode(name: str, kind: str, base: torch.Tensor | None, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tensor a delta version holds, from its base and its parts (as `encode` named them)."""
    if kind == DENSE:
        return parts[name]
    if base is None:
        raise DockValueError(f"weight {name!r} is a {kind} delta of a base version this reader does not have")
    if kind == SAME:
        return base
    if kind != SPARSE:
        raise DockValueError(f"weight {name!r} has an unknown delta kind {kind!r} (written by a newer dockd?)")
    idx, val = parts[name + IDX], parts[name + VAL]
    out = base.clone()
    out.view(-1)[idx.long()] = val.to(out.dtype) if val.dtype != out.dtype else val
    return out


def part_names(name: str, kind: str) -> list[str]:
    return {SAME: [], DENSE: [name], SPARSE: [name + IDX, name + VAL]}[kind]


class Rebuilder:
    """Tensors of a delta version from the parts as they come (in any order), yielded in the
    version's own order as soon as each one and those before it are rebuilt."""

    def __init__(self, order: list[str], kinds: Mapping[str, str], base: Mapping[str, torch.Tensor]) -> None:
        self.order, self.kinds, self.base = order, kinds, base
        self._owner = {p: n for n in order for p in part_names(n, kinds[n])}
        self._parts: dict[str, dict[str, torch.Tensor]] = {}
        self._ready: dict[str, torch.Tensor] = {}
        self._next = 0

    def feed(self, part: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        name = self._owner.get(part)
        if name is None:
            raise DockValueError(f"part {part!r} is not in this delta version's index")
        got = self._parts.setdefault(name, {})
        got[part] = tensor
        if len(got) == len(part_names(name, self.kinds[name])):
            self._ready[name] = decode(name, self.kinds[name], self.base.get(name), self._parts.pop(name))
        yield from self.flush()

    def flush(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._next < len(self.order):
            name = self.order[self._next]
            if self.kinds[name] == SAME:
                yield name, decode(name, SAME, self.base.get(name), {})
            elif name in self._ready:
                yield name, self._ready.pop(name)
            else:
                return
            self._next += 1

    @property
    def done(self) -> bool:
        return self._next == len(self.order)
