"""Finding libnccl.so.2 and libhccl.so.

NCCL, in order:
  1. the explicit path argument, then the DOCKD_NCCL_LIB environment variable
     (either one, when given, must exist: no fallback past a wrong explicit path);
  2. the nvidia-nccl-cu13 / nvidia-nccl-cu12 wheels: nvidia/nccl/lib/libnccl.so.2
     found through importlib (package nvidia.nccl), then by scanning sys.path;
  3. each directory of LD_LIBRARY_PATH (libnccl.so.2, then libnccl.so);
  4. ctypes.util.find_library("nccl"), then a plain dlopen of "libnccl.so.2".

HCCL, in order:
  1. the explicit path argument, then DOCKD_HCCL_LIB;
  2. $ASCEND_HOME_PATH/lib64/libhccl.so, then $ASCEND_TOOLKIT_HOME/lib64/libhccl.so;
  3. each directory of LD_LIBRARY_PATH;
  4. the default toolkit location /usr/local/Ascend/ascend-toolkit/latest/lib64;
  5. ctypes.util.find_library("hccl"), then a plain dlopen of "libhccl.so".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
import threading
from typing import TYPE_CHECKING

from dockd import config
from dockd.device.errors import DeviceArgumentError, DeviceLibraryNotFound

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr; its stub does not export that name

NCCL_ENV = "DOCKD_NCCL_LIB"
HCCL_ENV = "DOCKD_HCCL_LIB"
NCCL_NAMES = ("libnccl.so.2", "libnccl.so")
HCCL_NAMES = ("libhccl.so",)
ASCEND_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"

NCCL_INSTALL_HINT = (f"install it with `pip install nvidia-nccl-cu13` (CUDA 13 drivers) or "
                     f"`pip install nvidia-nccl-cu12` (CUDA 12), or set {NCCL_ENV}=/path/to/libnccl.so.2")
HCCL_INSTALL_HINT = ("install the Ascend CANN toolkit and source its set_env.sh (it sets ASCEND_HOME_PATH), "
                     f"or set {HCCL_ENV}=/path/to/libhccl.so")

_loaded: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    """A lock another thread of the parent held at a fork stays held in the child: take a fresh one."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _ld_library_dirs() -> list[str]:
    return [d for d in config.env("LD_LIBRARY_PATH").split(os.pathsep) if d]


def _wheel_nccl_candidates() -> list[str]:
    """nvidia/nccl/lib/libnccl.so.2 of the nvidia-nccl-cu1x wheels, importlib first, then sys.path."""
    out: list[str] = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            out.append(os.path.join(loc, "lib", "libnccl.so.2"))
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            cand = os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so.2")
            if cand not in out:
                out.append(cand)
    return out


def _dlopen(path: str) -> ctypes.CDLL:
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            lib = ctypes.CDLL(path)
            _loaded[path] = lib
        return lib


def _load_first(library: str, explicit: str | None, env: str, candidates: list[tuple[str, str]],
                soname: str, find_name: str, hint: str) -> tuple[ctypes.CDLL, str]:
    """Load the library; `candidates` are (origin, path) pairs tried in order if nothing explicit was given."""
    given = [(origin, p) for origin, p in (("path argument", explicit), (env, config.env(env) or None)) if p]
    if given:
        origin, path = given[0]
        if not os.path.exists(path):
            raise DeviceLibraryNotFound(f"{library}: {origin} points to {path!r}, which does not exist; {hint}",
                                        library=library, searched=[f"{origin}: {path}"])
        try:
            return _dlopen(path), path
        except OSError as e:
            raise DeviceLibraryNotFound(f"{library}: {origin} points to {path!r}, which cannot be loaded: {e}",
                                        library=library, searched=[f"{origin}: {path}"]) from e
    searched: list[str] = []
    errors: list[str] = []
    for origin, path in candidates:
        searched.append(f"{origin}: {path}")
        if os.path.isfile(path):
            try:
                return _dlopen(path), path
            except OSError as e:  # present but unloadable (wrong arch, missing deps): keep looking, report it
                errors.append(f"{path}: {e}")
    found = ctypes.util.find_library(find_name)
    searched.append(f"ctypes.util.find_library({find_name!r}): {found or 'nothing'}")
    for name in ([found] if found else []) + [soname]:
        searched.append(f"dlopen({name!r})")
        try:
            return _dlopen(name), name
        except OSError as e:
            errors.append(f"{name}: {e}")
    msg = f"{library} not found. Searched, in order: " + "; ".join(searched) + f". To fix: {hint}."
    if errors:
        msg += " Load errors: " + "; ".join(errors)
    raise DeviceLibraryNotFound(msg, library=library, searched=searched)


def load_nccl_library(path: str | None = None) -> tuple[ctypes.CDLL, str]:
    """Find and dlopen libnccl.so.2; returns (library, the path or name it was loaded from)."""
    cands = [("nvidia-nccl wheel", p) for p in _wheel_nccl_candidates()]
    cands += [("LD_LIBRARY_PATH", os.path.join(d, n)) for d in _ld_library_dirs() for n in NCCL_NAMES]
    return _load_first("libnccl.so.2", path, NCCL_ENV, cands, "libnccl.so.2", "nccl", NCCL_INSTALL_HINT)


def load_hccl_library(path: str | None = None) -> tuple[ctypes.CDLL, str]:
    """Find and dlopen libhccl.so; returns (library, the path or name it was loaded from)."""
    cands: list[tuple[str, str]] = []
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        home = config.env(var)
        cands.append((var, os.path.join(home, "lib64", "libhccl.so") if home else "(not set)"))
    cands += [("LD_LIBRARY_PATH", os.path.join(d, n)) for d in _ld_library_dirs() for n in HCCL_NAMES]
    cands.append(("default CANN location", os.path.join(ASCEND_DEFAULT, "lib64", "libhccl.so")))
    return _load_first("libhccl.so", path, HCCL_ENV, cands, "libhccl.so", "hccl", HCCL_INSTALL_HINT)


def bind(lib: ctypes.CDLL, path: str, signatures, too_old: str) -> dict[str, CFuncPtr]:
    """The library's functions typed by `signatures` ((name, restype, argtypes, required) each);
    a missing required one raises DeviceArgumentError saying `path` is not the library, or `too_old`."""
    fns: dict[str, CFuncPtr] = {}
    for fname, restype, argtypes, required in signatures:
        try:
            f = getattr(lib, fname)
        except AttributeError:
            if required:
                raise DeviceArgumentError(f"{path} has no symbol {fname}: {too_old}") from None
            continue
        f.restype = restype
        f.argtypes = argtypes
        fns[fname] = f
    return fns
