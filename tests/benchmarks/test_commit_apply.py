"""The in-process commit benchmark runs every batch size and applies every commit (no daemon started)."""

from __future__ import annotations

import pytest

from benchmarks import commit_apply


@pytest.mark.parametrize("kind", [[], ["--writes"]])
def test_each_batch_size_is_measured_and_every_commit_applied(capsys, kind):
    assert commit_apply.main(["--commits", "96", "--batch", "1,8,32", "--rounds", "1", *kind]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["1", "8", "32"]  # (each run asserts every commit applied)
