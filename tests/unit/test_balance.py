"""dockd.balance: equal-count, token-balanced splits of a global batch among DP ranks.

Every documented promise of `balance` is checked on its own: a partition of
the positions, equal counts, ascending rows, ranks ordered by their smallest
position, whole groups, determinism, the spread bound of the module
docstring (per chunk of ``k`` sorted neighbours, hence ``max(w) - min(w)``),
exact splits of equal weights, the argument errors; and, on realistic
long-tailed rollout lengths, that it is never worse than the greedy heap
partition (MindSpeed-RL's sequence-length balancing). No timing assertions.
"""

from __future__ import annotations

import doctest
import heapq

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dockd.balance as balance_module
from dockd.balance import balance, imbalance
from dockd.errors import DockTypeError, DockValueError

# ------------------------------------------------------------------ helpers


def rank_sums(weights, parts) -> np.ndarray:
    w = np.asarray(weights)
    return np.array([w[p].sum() for p in parts])


def spread(weights, parts):
    sums = rank_sums(weights, parts)
    return sums.max() - sums.min()


def chunk_bound(weights, k: int, g: int = 1):
    """The module docstring's bound: items (group sums) sorted, cut into chunks of k neighbours,
    the largest max - min within a chunk."""
    w = np.asarray(weights)
    items = w.reshape(-1, g).sum(axis=1) if g > 1 else w
    chunks = np.sort(items).reshape(-1, k)
    return (chunks[:, -1] - chunks[:, 0]).max()


def assert_valid_split(parts, n: int, k: int, g: int = 1) -> None:
    """Every structural promise of balance's Returns section."""
    assert isinstance(parts, list) and len(parts) == k
    count = n // k
    for p in parts:
        assert isinstance(p, np.ndarray) and p.dtype == np.int64 and p.ndim == 1
        assert len(p) == count, f"rank has {len(p)} samples, expected {count}"
        assert np.all(np.diff(p) > 0), f"positions not strictly ascending: {p.tolist()}"
    flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
    assert np.array_equal(np.sort(flat), np.arange(n)), "not every position exactly once"
    if count:
        firsts = [int(p[0]) for p in parts]
        assert firsts == sorted(firsts), f"ranks not ordered by smallest position: {firsts}"
    if g > 1:
        for p in parts:
            groups = p.reshape(-1, g)
            assert np.all(groups % g == np.arange(g)), "a group is split or out of order"
            assert np.all(groups // g == groups[:, :1] // g), "a group is split across ranks"


def greedy_heap(weights, k: int) -> list[list[int]]:
    """The equal-count greedy heap (MindSpeed-RL): largest first to the lightest rank with room."""
    w = [int(x) for x in weights]
    per_rank = len(w) // k
    heap = [[0, 0, r, []] for r in range(k)]
    full = []
    for x, i in sorted(((x, i) for i, x in enumerate(w)), reverse=True):
        rank = heapq.heappop(heap)
        rank[0] += x
        rank[1] += 1
        rank[3].append(i)
        if rank[1] < per_rank:
            heapq.heappush(heap, rank)
        else:
            full.append(rank)
    return [r[3] for r in full + heap]


def rollout_lengths(rng: np.random.Generator, n: int, g: int = 1) -> np.ndarray:
    """Long-tailed prompt + response lengths: prompt 64..1024 per group, response lognormal in 16..8192."""
    prompt = np.repeat(rng.integers(64, 1025, n // g), g)
    response = np.clip(np.round(rng.lognormal(6.5, 1.0, n)), 16, 8192).astype(np.int64)
    return prompt + response


# ------------------------------------------------------------------ examples


def test_docstring_example_is_balanced():
    parts = balance([5, 1, 1, 5, 3, 3], 2)
    assert_valid_split(parts, 6, 2)
    assert rank_sums([5, 1, 1, 5, 3, 3], parts).tolist() == [9, 9]


def test_docstring_example_doctest():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(balance_module.balance, "balance", globs={"balance": balance}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_single_rank_gets_everything_in_order():
    w = [3, 1, 4, 1, 5, 9, 2, 6]
    parts = balance(w, 1)
    assert len(parts) == 1 and parts[0].tolist() == list(range(8))
    parts = balance(w, 1, group_size=4)
    assert parts[0].tolist() == list(range(8))


@pytest.mark.parametrize("k,g", [(1, 1), (3, 1), (3, 4)])
def test_empty_input(k, g):
    parts = balance([], k, group_size=g)
    assert len(parts) == k
    assert all(p.dtype == np.int64 and p.shape == (0,) for p in parts)
    assert balance(np.empty(0, dtype=np.float32), k, group_size=g)[0].shape == (0,)


def test_one_sample_per_rank():
    parts = balance([7, 3, 9, 1], 4)
    assert [p.tolist() for p in parts] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("k,g,m", [(2, 1, 3), (4, 1, 100), (8, 1, 7), (3, 2, 5), (16, 8, 9), (5, 3, 200)])
@pytest.mark.parametrize("value", [0, 1, 1000, 2.5])
def test_equal_weights_split_exactly(k, g, m, value):
    w = np.full(k * g * m, value)
    parts = balance(w, k, group_size=g)
    assert_valid_split(parts, len(w), k, g)
    assert spread(w, parts) == 0


def test_two_values_split_exactly_when_possible():
    # k ranks, each can get the same multiset: the chunk bound is 0 here.
    w = np.array([1, 5] * 12)
    parts = balance(w, 4)
    assert_valid_split(parts, 24, 4)
    assert spread(w, parts) == 0


# ------------------------------------------------------------------ properties


@st.composite
def small_cases(draw):
    k = draw(st.integers(1, 6))
    g = draw(st.sampled_from([1, 1, 2, 3]))
    m = draw(st.integers(0, 12))
    hi = draw(st.sampled_from([1, 3, 50, 10_000]))
    w = draw(st.lists(st.integers(0, hi), min_size=k * g * m, max_size=k * g * m))
    return w, k, g


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cases())
def test_properties_small_integer_batches(case):
    w, k, g = case
    parts = balance(w, k, group_size=g)
    assert_valid_split(parts, len(w), k, g)
    if w:
        s = spread(w, parts)
        assert s <= chunk_bound(w, k, g)
        items = np.asarray(w).reshape(-1, g).sum(axis=1)
        assert s <= items.max() - items.min()


@st.composite
def float_cases(draw):
    k = draw(st.integers(2, 5))
    m = draw(st.integers(1, 10))
    w = draw(st.lists(st.floats(0, 1e6, allow_nan=False, allow_infinity=False), min_size=k * m, max_size=k * m))
    return w, k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float_cases())
def test_properties_float_weights(case):
    w, k = case
    parts = balance(w, k)
    assert_valid_split(parts, len(w), k)
    bound = chunk_bound(w, k)
    assert spread(w, parts) <= bound + 1e-9 * max(1.0, float(np.sum(w)))  # float sums round


def _random_weights(rng: np.random.Generator, kind: str, n: int, g: int) -> np.ndarray:
    if kind == "rollout":
        return rollout_lengths(rng, n, g)
    if kind == "uniform":
        return rng.integers(0, 8193, n)
    if kind == "few":
        return rng.integers(0, 4, n)
    if kind == "float":
        return rng.random(n) * 1000.0
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["rollout", "uniform", "few", "float"])
def test_properties_seeded_larger_batches(kind):
    """Sizes past SEQUENTIAL_STATES chunks, so the vectorized merge rounds run too."""
    rng = np.random.default_rng(1234)
    for _ in range(25):
        k = int(rng.choice([2, 3, 4, 8, 16, 32]))
        g = int(rng.choice([1, 1, 8]))
        m = int(rng.choice([1, 2, 9, 63, 64, 65, 130, 400]))
        w = _random_weights(rng, kind, k * g * m, g)
        parts = balance(w, k, group_size=g)
        assert_valid_split(parts, len(w), k, g)
        tol = 1e-9 * float(w.sum()) if kind == "float" else 0
        assert spread(w, parts) <= chunk_bound(w, k, g) + tol, (kind, k, g, m)


@pytest.mark.parametrize("states", [1, 2, 4, 7])
def test_bound_holds_whatever_the_sequential_cutoff(monkeypatch, states):
    """Force most merges through the vectorized rounds: the bound and validity must not depend on it."""
    monkeypatch.setattr(balance_module, "SEQUENTIAL_STATES", states)
    rng = np.random.default_rng(states)
    for _ in range(20):
        k = int(rng.integers(2, 9))
        m = int(rng.integers(1, 40))
        g = int(rng.choice([1, 2]))
        w = rng.integers(0, 200, k * m * g)
        parts = balance(w, k, group_size=g)
        assert_valid_split(parts, len(w), k, g)
        assert spread(w, parts) <= chunk_bound(w, k, g)


@pytest.mark.parametrize("states", [1, 3, 64])
def test_differencing_alone_meets_the_chunk_bound(monkeypatch, states):
    """The Guarantee's first half: the merges alone (refinement off) never exceed the chunk bound.

    The refinement only narrows the spread, so without this test a broken merge could hide behind it.
    """
    monkeypatch.setattr(balance_module, "_refine", lambda *args, **kwargs: None)
    monkeypatch.setattr(balance_module, "SEQUENTIAL_STATES", states)
    rng = np.random.default_rng(100 + states)
    for _ in range(30):
        k = int(rng.integers(2, 9))
        m = int(rng.choice([2, 5, 17, 80, 150]))
        w = rng.integers(0, 1000, k * m)
        parts = balance(w, k)
        assert_valid_split(parts, len(w), k)
        assert spread(w, parts) <= chunk_bound(w, k), (k, m)


def test_lengths_in_1_to_W_spread_below_W():
    rng = np.random.default_rng(7)
    for W in (2, 10, 4096):
        for k in (2, 5, 16):
            w = rng.integers(1, W + 1, k * 37)
            assert spread(w, balance(w, k)) <= W - 1


def test_deterministic_and_independent_of_input_container():
    rng = np.random.default_rng(99)
    w = rollout_lengths(rng, 8 * 8 * 20, 8)
    first = balance(w, 8, group_size=8)
    for again in (
        balance(w, 8, group_size=8),
        balance(w.copy(), 8, group_size=8),
        balance(w.tolist(), 8, group_size=8),
        balance(w.astype(np.int32), 8, group_size=8),
        balance(w.astype(np.uint32), 8, group_size=8),
        balance(w.astype(np.float64), 8, group_size=8),  # integral floats are treated as integers
        balance(w, np.int64(8), group_size=np.int32(8)),
    ):
        assert [p.tolist() for p in again] == [p.tolist() for p in first]
    assert np.array_equal(w, rollout_lengths(np.random.default_rng(99), 8 * 8 * 20, 8)), "input was modified"


def test_input_not_modified():
    w = np.array([9, 1, 8, 2, 7, 3, 6, 4], dtype=np.int64)
    before = w.copy()
    balance(w, 2)
    balance(w, 2, group_size=2)
    assert np.array_equal(w, before)


def test_groups_kept_whole_and_balanced_by_group_sum():
    # Groups (sums): [10, 10], [1, 1], [6, 6], [5, 5] -> 20, 2, 12, 10 -> {20, 2}, {12, 10}.
    w = [10, 10, 1, 1, 6, 6, 5, 5]
    parts = balance(w, 2, group_size=2)
    assert_valid_split(parts, 8, 2, 2)
    assert sorted(rank_sums(w, parts).tolist()) == [22, 22]
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_float_weights_non_integral():
    w = np.array([0.5, 1.25, 2.0, 3.75, 0.1, 0.2, 9.9, 4.4])
    parts = balance(w, 4)
    assert_valid_split(parts, 8, 4)
    assert spread(w, parts) <= chunk_bound(w, 4) + 1e-12
    parts32 = balance(w.astype(np.float32), 4)
    assert_valid_split(parts32, 8, 4)


def test_bool_and_unsigned_weights():
    parts = balance(np.array([True, False, True, False, True, False]), 3)
    assert_valid_split(parts, 6, 3)
    assert rank_sums(np.array([1, 0, 1, 0, 1, 0]), parts).tolist() == [1, 1, 1]
    w = np.array([4000, 1, 2, 3999], dtype=np.uint16)
    parts = balance(w, 2)
    assert sorted(rank_sums(w.astype(np.int64), parts).tolist()) == [4001, 4001]


def test_large_integers_stay_valid():
    # Totals past 2**62 fall back to float64 sums; the split must still be a valid one.
    w = np.array([2**61, 2**61, 3, 5, 2**60, 7, 11, 2**60], dtype=np.int64)
    parts = balance(w, 2)
    assert_valid_split(parts, 8, 2)


# ------------------------------------------------------------------ quality at scale


def test_large_batch_is_well_balanced():
    rng = np.random.default_rng(2024)
    w = rollout_lengths(rng, 65536)
    parts = balance(w, 16)
    assert_valid_split(parts, 65536, 16)
    s = spread(w, parts)
    assert s <= w.max()
    assert s <= chunk_bound(w, 16)
    assert imbalance(w, parts) < 1.0001  # 4096 long-tailed samples per rank: essentially exact
    grouped = balance(w, 16, group_size=8)
    assert_valid_split(grouped, 65536, 16, 8)
    assert spread(w, grouped) <= w.reshape(-1, 8).sum(axis=1).max()


@pytest.mark.parametrize("g", [1, 8])
def test_no_worse_than_greedy_heap_on_rollout_lengths(g):
    """Deterministic seeds; dp 2..32, 8..256 samples per rank."""
    for seed in range(3):
        rng = np.random.default_rng(seed)
        for k in (2, 4, 8, 16, 32):
            for count in (8, 64, 256):
                w = rollout_lengths(rng, k * count, g)
                ours = spread(w, balance(w, k, group_size=g))
                items = w.reshape(-1, g).sum(axis=1)
                theirs = spread(items, greedy_heap(items, k))
                assert ours <= theirs, (seed, k, count, ours, theirs)
                if count // g >= 32:  # tens of items per rank: far tighter than greedy
                    assert ours <= max(1, theirs // 4), (seed, k, count, ours, theirs)


def test_greedy_baseline_is_a_valid_equal_count_split():
    # Guards the comparison above: the baseline itself must be a real equal-count partition.
    rng = np.random.default_rng(3)
    w = rollout_lengths(rng, 8 * 32)
    parts = [np.array(sorted(p), dtype=np.int64) for p in greedy_heap(w, 8)]
    parts.sort(key=lambda p: p[0])
    assert_valid_split(parts, len(w), 8)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "weights,kwargs,exc,match",
    [
        ([1, 2], {"n_ranks": 0}, DockValueError, r"n_ranks must be at least 1, got 0"),
        ([1, 2], {"n_ranks": -2}, DockValueError, r"n_ranks must be at least 1, got -2"),
        ([1, 2], {"n_ranks": 2.0}, DockTypeError, r"n_ranks must be an integer, got float"),
        ([1, 2], {"n_ranks": "2"}, DockTypeError, r"n_ranks must be an integer, got str"),
        ([1, 2], {"n_ranks": None}, DockTypeError, r"n_ranks must be an integer"),
        ([1, 2], {"n_ranks": True}, DockTypeError, r"n_ranks must be an integer, got True"),
        ([1, 2], {"n_ranks": 1, "group_size": 0}, DockValueError, r"group_size must be at least 1, got 0"),
        ([1, 2], {"n_ranks": 1, "group_size": 2.0}, DockTypeError, r"group_size must be an integer, got float"),
        ([1, -2, 3, 4], {"n_ranks": 2}, DockValueError, r"non-negative.*-2"),
        ([1.0, -0.5], {"n_ranks": 2}, DockValueError, r"non-negative.*-0\.5"),
        ([1.0, float("nan")], {"n_ranks": 2}, DockValueError, r"finite"),
        ([1.0, float("inf")], {"n_ranks": 2}, DockValueError, r"finite"),
        ([1.0, float("-inf")], {"n_ranks": 2}, DockValueError, r"finite"),
        ([[1, 2], [3, 4]], {"n_ranks": 2}, DockValueError, r"1-D array, got shape \(2, 2\)"),
        (5, {"n_ranks": 1}, DockValueError, r"1-D array, got shape \(\)"),
        ([1, 2, 3], {"n_ranks": 2}, DockValueError,
         r"3 weights cannot be split into 2 ranks.*multiple of n_ranks \* group_size = 2"),
        ([1, 2, 3, 4], {"n_ranks": 2, "group_size": 3}, DockValueError,
         r"4 weights cannot be split into 2 ranks of whole groups of 3.*= 6"),
        ([1] * 12, {"n_ranks": 4, "group_size": 2}, DockValueError, r"= 8"),
        (["a", "b"], {"n_ranks": 2}, DockTypeError, r"weights must be numbers"),
        ([1 + 1j, 2], {"n_ranks": 2}, DockTypeError, r"weights must be numbers, got dtype complex"),
        ([None, 1], {"n_ranks": 2}, DockTypeError, r"weights must be numbers, got dtype object"),
    ],
)
def test_errors(weights, kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        balance(weights, **kwargs)
    assert isinstance(info.value, ValueError if exc is DockValueError else TypeError)


def test_n_ranks_checked_before_weights():
    with pytest.raises(DockValueError, match="n_ranks"):
        balance([[1, 2]], 0)


# ------------------------------------------------------------------ imbalance


def test_imbalance():
    assert imbalance([5, 1, 1, 5, 3, 3], balance([5, 1, 1, 5, 3, 3], 2)) == 1.0
    assert imbalance([1, 2, 3, 4], [[0, 1], [2, 3]]) == pytest.approx(7 / 3)
    assert imbalance([0, 0], [[0], [1]]) == 1.0
    assert imbalance([0, 1], [[0], [1]]) == float("inf")
    assert imbalance(np.array([2.0, 2.0, 3.0]), [np.array([0, 1]), np.array([2])]) == pytest.approx(4 / 3)


def test_imbalance_errors():
    with pytest.raises(DockValueError, match="parts is empty"):
        imbalance([1, 2], [])
    with pytest.raises(DockValueError, match="1-D"):
        imbalance([[1, 2]], [[0]])


def test_weights_whose_sum_overflows_are_refused():
    with pytest.raises(DockValueError, match="overflows"):
        balance([1e308] * 8, 2)
