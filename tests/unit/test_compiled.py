"""The modules setup.py compiles with mypyc: each one's pure-Python source is its fallback.

In the normal run (an editable install: the sources) every listed module must exist and import from its
`.py`. `make test-compiled` runs the unit tests in a compiled copy of the checkout with
DOCKD_EXPECT_COMPILED=1: there every listed module must be the extension, and its `.py` must still
import on its own as plain Python (what a build without a compiler installs).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def compiled_list() -> list[str]:
    """setup.py's COMPILED, read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILED" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no COMPILED list")


MODULES = compiled_list()


def _name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def test_every_listed_module_exists() -> None:
    missing = [p for p in MODULES if not (ROOT / p).is_file()]
    assert not missing, f"setup.py's COMPILED names modules that are gone: {missing}; update the list"


def test_every_controller_module_is_listed() -> None:
    """The controller's request path is compiled whole: a module added to dockd/controller/ and left off the
    list runs interpreted in the compiled build (five were, measured at 0.85-0.90x where 1.5x was expected)."""
    have = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dockd" / "controller").glob("*.py")}
    left_out = sorted(have - set(MODULES) - {"dockd/controller/__init__.py"})
    assert not left_out, f"add {left_out} to setup.py's COMPILED (or say there why a module stays interpreted)"


@pytest.mark.parametrize("path", MODULES)
def test_module_is_compiled_where_expected(path: str) -> None:
    mod = importlib.import_module(_name(path))
    suffix = pathlib.Path(mod.__file__ or "").name
    is_ext = any(suffix.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)
    if os.environ.get("DOCKD_EXPECT_COMPILED") == "1":
        assert is_ext, f"{_name(path)} was imported from {mod.__file__}, not from its compiled extension"
    else:
        assert not is_ext, (f"{_name(path)} was imported from the extension {mod.__file__}: an extension next "
                            "to the sources shadows their edits; remove it (compiled builds go to dist/ only)")


@pytest.mark.parametrize("path", MODULES)
def test_pure_fallback_imports(path: str) -> None:
    """The `.py` of each listed module runs as plain Python (under a private name, beside the imported one)."""
    name = "_dockd_pure_" + _name(path).replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (dataclasses look their module up by name)
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    assert isinstance(mod.__loader__, importlib.machinery.SourceFileLoader)
