"""The jagged-get benchmark's consumer: it reads every byte, its batches one ahead come in order, and a
short run against real daemons gives each case's figure against the same run's memcpy."""

from __future__ import annotations

import pytest
import torch

from benchmarks.jagged_get import Ahead, measure, read_words


@pytest.mark.parametrize("dtype,n", [(torch.int64, 5), (torch.float32, 7), (torch.bool, 9), (torch.bfloat16, 3),
                                     (torch.float32, 0)])
def test_read_words_sums_every_byte_of_the_buffer(dtype, n):
    t = torch.arange(1, n + 1).to(dtype) if dtype != torch.bool else torch.ones(n, dtype=torch.bool)
    for v in (t, t[1:]):  # (an offset view: words its address is aligned to)
        raw = v.view(torch.uint8).numpy()
        width = next(w for w in (8, 4, 2, 1) if raw.size % w == 0 and v.data_ptr() % w == 0)
        words = raw.view({8: "<i8", 4: "<i4", 2: "<i2", 1: "u1"}[width])
        assert read_words(v) == int(words.astype("int64").sum())


def test_ahead_yields_each_batch_in_order_and_raises_what_a_get_raised():
    got = iter(range(5))
    assert list(Ahead(lambda: next(got), 5)) == [0, 1, 2, 3, 4]

    def failing():
        raise KeyError("gone")

    with pytest.raises(KeyError, match="gone"):
        list(Ahead(failing, 2))


def test_a_short_run_measures_every_case_against_memcpy():
    res = measure(samples=128, repeats=1, prefetch=2)
    assert res["memcpy_batch_GBps"] > 0 and res["bytes_per_sample"] > 20_000
    for case in ("get", "prefetch", "overlap", "packed", "call"):
        assert res[f"{case}_ms_per_get"] > 0 and res[f"{case}_vs_memcpy"] > 0


def test_gets_larger_than_the_puts_take_every_sample_and_a_batch_that_does_not_divide_is_refused():
    res = measure(samples=128, repeats=1, prefetch=2, batch=128, cases=("packed", "get"))
    assert res["batch"] == 128 and res["packed_ms_per_get"] > 0 and res["get_vs_memcpy"] > 0
    with pytest.raises(ValueError, match="multiple of --batch"):
        measure(samples=128, repeats=1, batch=96)
