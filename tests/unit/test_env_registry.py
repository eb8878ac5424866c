"""Every DOCKD_* environment variable the code names is registered, with its meaning, in
dockd.config.ENV_VARS (the one place a user looks them up), and dockd.config is the only module
that reads the environment (`config.env`, which refuses names that are not registered)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from dockd import config
from dockd.config import ENV_VARS, FOREIGN_ENV

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_VARIABLES = {"DOCKD_SHARD"}  # verl's dispatch mode named DOCKD_SHARD, not a variable



def test_every_variable_the_code_names_is_registered():
    named: dict[str, str] = {}
    for folder in ("dockd", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if "_proto" in path.parts:
                continue
            for name in re.findall(r"[\"'](DOCKD_[A-Z0-9_]+)[\"']", path.read_text()):
                named.setdefault(name, str(path.relative_to(ROOT)))
    assert "DOCKD_TOKEN_FILE" in named  # the scan sees the code
    missing = {n: where for n, where in named.items() if n not in ENV_VARS and n not in NOT_VARIABLES}
    assert not missing, f"register these in dockd.config.ENV_VARS: {missing}"
    assert all(text.strip() for text in ENV_VARS.values())


def test_foreign_variables_are_registered_apart_and_env_refuses_the_rest(monkeypatch):
    assert not ENV_VARS.keys() & FOREIGN_ENV.keys()
    assert all(not name.startswith("DOCKD_") and text.strip() for name, text in FOREIGN_ENV.items())
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert config.env("XDG_RUNTIME_DIR", "/tmp") == "/run/user/1234"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert config.env("XDG_RUNTIME_DIR", "/tmp") == "/tmp"  # empty counts as unset
    monkeypatch.setenv("HOME", "/root")
    with pytest.raises(KeyError, match="FOREIGN_ENV"):
        config.env("HOME")


# -- one reader of the environment ----------------------------------------------------------------------
_READ_METHODS = {"get", "items", "keys", "values", "copy", "__getitem__", "__contains__"}
_WRITE_METHODS = {"pop", "setdefault", "update", "clear", "popitem", "__setitem__", "__delitem__"}


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` (or `environ` imported from os)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id in ("os", "posix")
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_copy_for_a_child(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """`dict(os.environ, ...)` or `os.environ.copy()`: the environment handed to a child process."""
    parent = parents.get(node)
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "dict":
        return bool(parent.args) and parent.args[0] is node
    return isinstance(parent, ast.Attribute) and parent.attr == "copy"


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every place `source` reads the environment: os.environ.get / [...] as a value /
    `in os.environ` / os.getenv; writes (assignment, del, pop, setdefault, update) and copies of the
    whole environment for a child process (`dict(os.environ, ...)`, `.copy()`) are not reads."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in ("getenv", "getenvb")
                    and isinstance(func.value, ast.Name) and func.value.id == "os") or \
                    (isinstance(func, ast.Name) and func.id in ("getenv", "getenvb")):
                found.append((node.lineno, "os.getenv(...)"))
            elif (isinstance(func, ast.Attribute) and _is_environ(func.value) and func.attr in _READ_METHODS
                  and not _is_copy_for_a_child(func.value, parents)):
                found.append((node.lineno, f"os.environ.{func.attr}(...)"))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, "os.environ[...]"))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            found.append((node.lineno, "... in os.environ"))
    return sorted(found)


def test_the_scan_tells_reads_from_writes():
    reads = environment_reads(
        "import os\n"
        "a = os.environ.get('X')\n"           # 2: read
        "b = os.environ['X']\n"                # 3: read
        "c = os.getenv('X')\n"                 # 4: read
        "d = 'X' in os.environ\n"              # 5: read
        "os.environ['X'] = '1'\n"              # write
        "os.environ.pop('X', None)\n"          # write
        "os.environ.setdefault('X', '1')\n"    # write
        "del os.environ['X']\n"                # write
        "e = dict(os.environ, X='1')\n"        # a child's environment
        "f = {'X': os.environ['Y']}\n"         # 11: read
    )
    assert [line for line, _ in reads] == [2, 3, 4, 5, 11]


def test_only_config_reads_the_environment():
    offenders: list[str] = []
    for path in sorted((ROOT / "dockd").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "_proto" in path.parts or rel == "dockd/config.py":
            continue
        offenders += [f"{rel}:{line} {what}" for line, what in environment_reads(path.read_text())]
    assert not offenders, ("read the environment through dockd.config.env (registering the variable in "
                            "ENV_VARS, or FOREIGN_ENV for another program's), not directly:\n  "
                            + "\n  ".join(offenders))
