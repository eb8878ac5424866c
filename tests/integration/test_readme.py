"""The README's quickstart runs as written, and prints what the README says it prints."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quickstart_block_runs():
    text = (ROOT / "README.md").read_text()
    section = re.search(r"## Quickstart\s+```python\n(.*?)```(.*?)(?=\n## )", text, re.S)
    block, after = section.group(1), section.group(2)
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
    # the output shown under "It prints:" is what a pasted script prints
    shown = re.search(r"It prints:\s+```\n(.*?)```", after, re.S)
    assert shown, "the Quickstart shows no output block after 'It prints:'"
    assert out.stdout.strip().splitlines() == shown.group(1).strip().splitlines(), out.stdout
