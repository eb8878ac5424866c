"""The dtypes a run may have: their item sizes (`ITEMSIZE`), and names to and from torch's dtypes
(`DTYPES`, `NAMES`), filled when the codec first uses torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dockd._lazy import ensure, lazy_torch

if TYPE_CHECKING:
    import torch

# the dtypes a run may have, with their item sizes (torch >= 2.3 has every one of them)
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}



class _Dtypes(dict):
    """name -> torch.dtype, filled when this module first uses torch. Indexing a filled entry is a
    plain dict lookup; a miss, and reading the whole mapping, import torch first."""

    def _filled(self) -> _Dtypes:
        if not dict.__len__(self):
            ensure(torch)
        return self

    def __missing__(self, key: str) -> torch.dtype:
        if dict.__len__(self):
            raise KeyError(key)
        return self._filled()[key]

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self._filled(), key)

    def __iter__(self):
        return dict.__iter__(self._filled())

    def __len__(self) -> int:
        return dict.__len__(self._filled())

    def __repr__(self) -> str:
        return dict.__repr__(self._filled())

    def get(self, key, default=None):
        return dict.get(self._filled(), key, default)

    def keys(self):
        return dict.keys(self._filled())

    def values(self):
        return dict.values(self._filled())

    def items(self):
        return dict.items(self._filled())


DTYPES: dict[str, torch.dtype] = _Dtypes()
# torch.dtype -> name; filled with DTYPES. Every use follows a `torch.` in the same function (a value
# was first recognised as a tensor), so it is filled by then.
NAMES: dict[torch.dtype, str] = {}


def loaded(module) -> None:
    """Fill DTYPES and NAMES from torch (`module`): the `on_load` hook of every codec module's torch
    (`dockd._lazy`), so that they are filled whichever module imports torch first."""
    if not dict.__len__(DTYPES):
        dtypes = {name: getattr(module, name) for name in ITEMSIZE if hasattr(module, name)}
        NAMES.update({dt: name for name, dt in dtypes.items()})
        dict.update(DTYPES, dtypes)


if not TYPE_CHECKING:
    torch = lazy_torch(globals(), on_load=loaded)
