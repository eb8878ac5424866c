"""torch, imported when a module first uses it rather than when the module is imported.

The client's modules reach torch only inside functions that build or read tensors, so
`dockd status`, `stats` and `clear` (and any client that never puts or gets a tensor) do
not pay torch's import (about 2 s). A module writes

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_torch(globals())

and uses `torch.X` as before. The first attribute read imports torch, puts the real module
in place of the stand-in in that module's globals (so later uses are a plain global lookup,
as with a module-level import) and runs the module's `on_load` hook, once.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    """A lock another thread of the parent held at a fork stays held in the child: take a fresh one."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


class LazyModule:
    """Stands for a module in one namespace until one of its attributes is read."""

    __slots__ = ("_name", "_namespace", "_binding", "_on_load", "_module")

    def __init__(self, name: str, namespace: dict[str, Any], binding: str, on_load: Callable[[Any], None] | None) -> None:
        self._name = name
        self._namespace = namespace
        self._binding = binding
        self._on_load = on_load
        self._module: Any = None

    def load(self) -> Any:
        if self._module is None:
            module = importlib.import_module(self._name)
            with _lock:
                if self._module is None:
                    if self._on_load is not None:
                        self._on_load(module)
                    if self._namespace.get(self._binding) is self:
                        self._namespace[self._binding] = module
                    self._module = module
        return self._module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


def lazy_torch(namespace: dict[str, Any], binding: str = "torch",
               on_load: Callable[[Any], None] | None = None) -> Any:
    """A stand-in for `torch` in `namespace` (a module's globals()), under the name `binding`."""
    return LazyModule("torch", namespace, binding, on_load)


def ensure(stand_in: Any) -> Any:
    """The real module behind a stand-in (or the module itself, once it replaced the stand-in)."""
    return stand_in.load() if isinstance(stand_in, LazyModule) else stand_in
