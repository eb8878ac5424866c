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


def test_errors_list_names_every_public_exception():
    import dockd

    text = (ROOT / "README.md").read_text()
    errors = re.search(r"^- Errors: (.*?)(?:\n\n|\n- )", text, re.S | re.M).group(1)
    for name in dockd.__all__:
        if name.startswith("Dock") and name != "Dock":
            assert f"{name}`" in errors, name


def test_demo_table_has_the_demos_layout():
    """The demo table quoted in the README is the one `dockd demo` prints (same header, stages, summary)."""
    from dockd.demo import StageReport, format_table

    text = (ROOT / "README.md").read_text()
    shown = re.search(r"`make run` prints.*?```\n(.*?)```", text, re.S).group(1).strip().splitlines()
    fresh = format_table([StageReport(s, 1, 1, 1, 1.0, 1.0) for s in ("rollout", "reward", "reference", "advantage",
                                                                      "train")],
                         steps=12, total=256, warehouses=2, wall=1.0).splitlines()
    assert shown[0] == fresh[0]
    assert [line.split()[0] for line in shown[1:6]] == [line.split()[0] for line in fresh[1:6]]
    assert shown[6].startswith("12 steps x 256 samples through 2 warehouses in ") and shown[7] == fresh[7]
    assert "2-core VM" in text.split("`make run` prints", 1)[1][:400]
