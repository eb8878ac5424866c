"""The documentation site builds with `mkdocs build --strict`, API reference included.

A broken link or anchor between pages, a page missing from the nav, or a
docstring that mkdocstrings cannot render fails the build, so the docs cannot
rot unnoticed. `make docs` runs the same build into site/.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _missing(module: str) -> bool:
    parent = module.rpartition(".")[0]
    return (bool(parent) and _missing(parent)) or importlib.util.find_spec(module) is None


# mkdocs, mkdocstrings and its Python handler (package mkdocstrings-python)
_MISSING = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if _missing(m)]


@pytest.mark.skipif(bool(_MISSING), reason=f"docs toolchain not installed ({', '.join(_MISSING)}): "
                                           "pip install -e '.[dev]'")
def test_docs_build_strict(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    # the API reference was generated from the docstrings, not left empty
    api = (site / "api" / "dockd" / "index.html").read_text()
    for name in ("connect", "start_local", "Dock", "AsyncDock", "Batch", "Lease", "DockTimeout", "DockDataLost"):
        assert f'id="dockd.{name}"' in api or f'id="dockd.errors.{name}"' in api, name
    # the README is published, and the design doc's links to it point at that page
    assert (site / "readme" / "index.html").is_file()
    assert 'href="../readme/#security-and-guarantees"' in (site / "design" / "index.html").read_text()


def test_no_reference_to_removed_design_notes() -> None:
    """docs/design-notes.md became docs/design.md: nothing under docs/ or in the README points at the old name."""
    stale = [str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
             if "design-notes" in p.read_text()]
    assert not stale, stale


def test_the_api_reference_lists_every_public_dock_call() -> None:
    """docs/api/dockd.md names Dock's members one by one (their order; the partition calls are
    inherited from PartitionCalls): a public method, or documented property, that is not in that list
    would be missing from the API reference."""
    import dockd

    block = (ROOT / "docs" / "api" / "dockd.md").read_text().split("::: dockd.Dock\n", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^ +- (\w+)$", block, re.M)
    public = [n for n in dir(dockd.Dock) if not n.startswith("_") and (
        inspect.isfunction(getattr(dockd.Dock, n)) or isinstance(getattr(dockd.Dock, n), property)
        and getattr(dockd.Dock, n).__doc__)]
    assert len(listed) == len(set(listed)) and sorted(listed) == sorted(public), (listed, public)
