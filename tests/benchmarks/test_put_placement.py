"""The put-placement benchmark: a short run against a real daemon gives each repeat's put against the same
run's memcpy, and a pinned run gives this process its CPUs back."""

from __future__ import annotations

import os

import pytest

from benchmarks.put_placement import main, measure


def test_a_short_run_measures_each_repeat_against_memcpy():
    res = measure(mib=1, puts=3, repeats=2)
    assert res["memcpy_GBps"] > 0 and len(res["repeats"]) == 2
    for r in res["repeats"]:
        assert r["us_per_put"] > 0 and r["vs_memcpy"] > 0 and r["client_cpu_us"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs two CPUs")
def test_a_pinned_run_gives_this_process_its_cpus_back(tmp_path):
    before = os.sched_getaffinity(0)
    assert main(["--puts", "2", "--repeats", "1", "--pin", "apart", "--json", str(tmp_path / "out.json")]) == 0
    assert os.sched_getaffinity(0) == before
    assert (tmp_path / "out.json").read_text().count('"us_per_put"') == 1
