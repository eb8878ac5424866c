"""Every DOCKD_* environment variable the code names is registered, with its meaning, in
dockd.config.ENV_VARS (the one place a user looks them up)."""

from __future__ import annotations

import pathlib
import re

from dockd.config import ENV_VARS

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
