"""The README's quickstart runs as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quickstart_block_runs():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", text, re.S).group(1)
    checks = """
assert idx == list(range(16)), idx
assert batch.indexes == list(range(16))
assert batch["responses"][0].dtype == torch.bfloat16
assert tokens.shape == (16, 9) and lengths.shape == (16,)
"""
    # run it inside the `with` block, before the cluster stops
    lines = block.rstrip().splitlines()
    body = "\n".join(lines) + "\n" + "\n".join("    " + l for l in checks.strip().splitlines()) + "\n"
    out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
