"""Token-balanced split of one global batch among data-parallel ranks.

`balance` takes one weight per sample (its prompt + response length, or any
other non-negative cost) and deals the batch out to ``n_ranks`` data-parallel
ranks so that every rank receives exactly the same number of samples and the
per-rank weight sums are as equal as possible. With ``group_size > 1`` the
samples come in consecutive groups (GRPO: the responses to one prompt) that
always go to one rank together; a group weighs the sum of its members.

Algorithm
---------
The items (samples, or groups) are split in three steps. Let ``k`` be the
number of ranks and ``m`` the number of items per rank.

1. **Chunks.** Sort the items by weight and cut the sorted list into ``m``
   chunks of ``k`` neighbours. A chunk is a partial solution ("state"): ``k``
   sets of one item each, so every chunk gives every rank exactly one item and
   the cardinalities stay equal whatever happens next.

2. **Differencing (Karmarkar-Karp, largest differencing method, k-way with
   equal cardinality).** Two states are merged by joining the heaviest set of
   one with the lightest set of the other, the second heaviest with the second
   lightest, and so on; a state's *spread* is its heaviest minus its lightest
   set. The classic method merges the two states of largest spread until one
   is left. Done one merge at a time that is ``m - 1`` heap operations on
   ``k``-vectors, too slow for ``m`` in the thousands in Python, so the many
   states of small spread are first merged pairwise in vectorized rounds
   (neighbours by spread) until at most `SEQUENTIAL_STATES` remain, keeping the
   states of largest spread out of those rounds; the rest is the exact
   sequential method.

3. **Refinement.** While the heaviest and the lightest rank differ by more
   than the smallest possible exchange, swap one item of the heaviest rank
   with one item of a lighter rank (the lightest first), choosing the pair
   whose weight difference is closest to half the gap. A swap keeps the
   counts and never raises the heaviest sum nor lowers the lightest one.

The final order of the ranks is by their smallest position, and each rank's
positions are ascending; the result depends only on the input.

Guarantee
---------
Merging two states whose spreads are ``a`` and ``b`` as above yields a
spread of at most ``max(a, b)`` (the heavy-to-light pairing can only shrink
the differences), and a refinement swap of ``d`` between ranks whose sums
differ by ``g`` requires ``0 < d < g``, which leaves both new sums strictly
between the old ones. Hence, with ``w`` the item weights sorted ascending::

    max_rank_sum - min_rank_sum <= max over chunks t of (w[t*k + k - 1] - w[t*k])
                                <= max(w) - min(w)

In particular for lengths in ``[1, W]`` the token spread never exceeds
``W - 1`` (greedy list scheduling only promises about ``W``), and an input
whose items are all equal is split exactly. In practice the result is far
tighter: on long-tailed rollout lengths with tens of samples per rank or more
the spread is typically at most one token.

Cost: one sort of the item weights (a radix sort when they are integers below
2**32), O(n log n) vectorized work for the rounds, and a few dozen to a few
hundred O(m) vectorized steps for the sequential phase and the refinement.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dockd.errors import DockTypeError, DockValueError

__all__ = ["balance", "imbalance", "SEQUENTIAL_STATES"]

SEQUENTIAL_STATES = 64
"""At most this many states go through the exact one-merge-at-a-time phase."""

_WORK_PER_ITEM = 64     # refinement budget: items searched per item ...
_WORK_CAP = 1 << 22     # ... but no more than this many in all
_EXACT_LIMIT = 1 << 62  # integer weights are summed exactly below this total


def balance(weights: ArrayLike, n_ranks: int, *, group_size: int = 1) -> list[np.ndarray]:
    """Split a global batch among data-parallel ranks with equal counts and balanced weight.

    Args:
        weights: 1-D array-like of non-negative finite numbers, one per sample
            (e.g. prompt + response length). Its length must be a multiple of
            ``n_ranks * group_size``.
        n_ranks: Number of data-parallel ranks (at least 1).
        group_size: Samples come in consecutive groups of this size (the
            responses of one prompt) that are never split across ranks.

    Returns:
        ``n_ranks`` int64 arrays of sample positions in ``0..len(weights)-1``.
        Every position appears in exactly one array, every array holds
        ``len(weights) // n_ranks`` positions in ascending order, and each
        group ``[j * group_size, (j + 1) * group_size)`` lies in one array.
        Ranks are ordered by their smallest position. The result depends only
        on the input.

    Raises:
        DockValueError: (a ValueError) ``n_ranks`` or ``group_size`` below 1,
            ``weights`` not 1-D, negative, NaN or infinite, or its length not a
            multiple of ``n_ranks * group_size``.
        DockTypeError: (a TypeError) ``n_ranks`` or ``group_size`` not an
            integer, or ``weights`` not numeric.

    Examples:
        >>> [p.tolist() for p in balance([5, 1, 1, 5, 3, 3], 2)]
        [[0, 2, 5], [1, 3, 4]]
    """
    k = _int_arg("n_ranks", n_ranks)
    g = _int_arg("group_size", group_size)
    w = _weights(weights)
    n = len(w)
    if n % (k * g):
        raise DockValueError(
            f"balance: {n} weights cannot be split into {k} ranks of whole groups of {g} "
            f"(the length must be a multiple of n_ranks * group_size = {k * g})"
        )
    count = n // k
    if count == 0:
        return [np.empty(0, dtype=np.int64) for _ in range(k)]
    items = w.reshape(-1, g).sum(axis=1) if g > 1 else w
    if k == 1:
        members = np.arange(len(items), dtype=np.int64).reshape(1, -1)
    else:
        members = _partition(items, k)
    if g > 1:
        members = (members[:, :, None] * g + np.arange(g, dtype=np.int64)).reshape(k, count)
    members = members[np.argsort(members[:, 0], kind="stable")]
    return list(members)


def imbalance(weights: ArrayLike, parts: Sequence[ArrayLike] | np.ndarray) -> float:
    """The ratio of the heaviest to the lightest part.

    Args:
        weights: 1-D array-like of per-sample weights.
        parts: Sequence of index arrays into ``weights`` (e.g. `balance`'s result).

    Returns:
        ``max(sums) / min(sums)`` of the per-part weight sums; ``1.0`` when all
        sums are zero and ``inf`` when some part sums to zero and another does not.

    Raises:
        DockValueError: (a ValueError) ``parts`` is empty or ``weights`` is not 1-D.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise DockValueError(f"imbalance: weights must be 1-D, got shape {w.shape}")
    if len(parts) == 0:
        raise DockValueError("imbalance: parts is empty")
    sums = np.array([w[np.asarray(p, dtype=np.int64)].sum() for p in parts])
    hi, lo = float(sums.max()), float(sums.min())
    if hi == 0.0:
        return 1.0
    if lo == 0.0:
        return float("inf")
    return hi / lo


# ---------------------------------------------------------------- arguments


def _int_arg(name: str, value: Any) -> int:  # any caller value, validated here
    if isinstance(value, bool | np.bool_):
        raise DockTypeError(f"balance: {name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise DockTypeError(f"balance: {name} must be an integer, got {type(value).__name__}") from None
    if v < 1:
        raise DockValueError(f"balance: {name} must be at least 1, got {v}")
    return v


def _weights(weights: ArrayLike) -> np.ndarray:
    """The weights as int64 when they are integers with an exact sum, else float64."""
    w = np.asarray(weights)
    if w.ndim != 1:
        raise DockValueError(f"balance: weights must be a 1-D array, got shape {w.shape}")
    if w.dtype.kind not in "biuf":
        raise DockTypeError(f"balance: weights must be numbers, got dtype {w.dtype}")
    if len(w) == 0:
        return w.astype(np.int64)
    if w.dtype.kind == "f" and not np.isfinite(w).all():
        raise DockValueError("balance: weights must be finite (got NaN or infinity)")
    if w.dtype.kind != "u" and w.dtype.kind != "b" and (w < 0).any():
        raise DockValueError(f"balance: weights must be non-negative, got {w.min().item()!r}")
    with np.errstate(over="ignore"):
        total = float(w.sum(dtype=np.float64))
    if not np.isfinite(total):
        raise DockValueError("balance: the weights' sum overflows a float64; scale them down")
    if total < _EXACT_LIMIT and (w.dtype.kind != "f" or np.array_equal(w, np.floor(w))):
        return w.astype(np.int64)
    return w.astype(np.float64)


# ---------------------------------------------------------------- partition


def _partition(items: np.ndarray, k: int) -> np.ndarray:
    """Item indices per rank, shape (k, len(items) // k), each row ascending; k >= 2."""
    m = len(items) // k
    order = _argsort(items)
    ws = items[order]
    rank_of_sorted = _differencing(ws, k)
    # Stable grouping by rank: each row lists sorted positions ascending, so its weights ascend.
    members = _argsort(rank_of_sorted).reshape(k, m)
    if m > 1:
        _refine(ws, members, _min_step(ws))
    rank_of_item = np.empty(len(items), dtype=np.int64)
    rank_of_item[order[members]] = np.arange(k)[:, None]
    return _argsort(rank_of_item).reshape(k, m)


def _argsort(x: np.ndarray) -> np.ndarray:
    """A stable argsort; a radix sort (one or two 16-bit passes) for small non-negative integers."""
    if x.dtype.kind in "iu" and len(x) > 256 and x.min() >= 0:
        top = int(x.max())
        if top < 1 << 16:
            return np.argsort(x.astype(np.uint16), kind="stable")
        if top < 1 << 32:
            low = np.argsort((x & 0xFFFF).astype(np.uint16), kind="stable")
            return low[np.argsort((x[low] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(x, kind="stable")


def _min_step(ws: np.ndarray) -> np.generic | int:
    """The smallest positive difference between two item weights (ws sorted); 0 if all equal."""
    steps = np.diff(ws)
    steps = steps[steps > 0]
    if not len(steps):
        return 0
    least: np.generic = steps.min()
    return least


def _differencing(ws: np.ndarray, k: int) -> np.ndarray:
    """Equal-cardinality k-way largest differencing on sorted weights; returns the rank of each."""
    n = len(ws)
    m = n // k
    sums = ws.reshape(m, k)[:, ::-1]  # each chunk's sets, heaviest first
    labels = np.arange(n, dtype=np.int64).reshape(m, k)[:, ::-1]
    joins: list[tuple[np.ndarray, np.ndarray]] = []  # (absorbed set labels, absorbing set labels)

    # Vectorized rounds: merge the states of smallest spread pairwise until few are left.
    keep = SEQUENTIAL_STATES // 2
    while len(sums) > SEQUENTIAL_STATES:
        by_spread = np.argsort(sums[:, -1] - sums[:, 0], kind="stable")  # largest spread first
        pairs = (len(sums) - keep) // 2
        lo = len(sums) - 2 * pairs
        a, b = by_spread[lo::2], by_spread[lo + 1::2]
        merged = sums[a] + sums[b, ::-1]
        absorbing = labels[a]
        joins.append((labels[b, ::-1].ravel(), absorbing.ravel()))
        resort = np.argsort(-merged, axis=1, kind="stable")
        rest = by_spread[:lo]
        sums = np.concatenate([sums[rest], np.take_along_axis(merged, resort, axis=1)])
        labels = np.concatenate([labels[rest], np.take_along_axis(absorbing, resort, axis=1)])

    # The exact method on what is left: repeatedly merge the two states of largest spread.
    state_sums = [row for row in np.ascontiguousarray(sums)]
    state_labels = [row for row in np.ascontiguousarray(labels)]
    heap = [(-(s[0] - s[-1]), -s[0], i) for i, s in enumerate(state_sums)]
    heapq.heapify(heap)
    while len(heap) > 1:
        i = heapq.heappop(heap)[2]
        j = heapq.heappop(heap)[2]
        merged = state_sums[i] + state_sums[j][::-1]
        joins.append((state_labels[j][::-1], state_labels[i]))
        resort = np.argsort(-merged, kind="stable")
        state_sums[i], state_labels[i] = merged[resort], state_labels[i][resort]
        heapq.heappush(heap, (-(state_sums[i][0] - state_sums[i][-1]), -state_sums[i][0], i))

    rank = np.empty(n, dtype=np.int64)
    rank[state_labels[heap[0][2]]] = np.arange(k)
    for absorbed, absorbing in reversed(joins):
        rank[absorbed] = rank[absorbing]
    return rank


def _refine(ws: np.ndarray, members: np.ndarray, step: np.generic | int) -> None:
    """Swap single items between heavy and light ranks in place.

    Each round looks at the heaviest and the lightest rank still in play and
    makes the best swap between them. Failing that, it makes the best swap of
    the heaviest with any other rank (the one that most reduces the sum of
    squared loads), or else takes the heaviest out of play and does the same
    for the lightest. A rank out of play keeps its load unless another rank
    swaps with it, so the others go on balancing among themselves. Stops when
    the heaviest and the lightest in play are within ``step`` or the work
    budget (`_WORK_PER_ITEM` items searched per item, at most `_WORK_CAP`) is
    spent.

    Args:
        ws: Item weights sorted ascending.
        members: (k, m) indices into ws per rank, each row ascending; updated in place.
        step: The smallest positive difference between two weights.
    """
    k, m = members.shape
    loads = ws[members]  # rows ascending: members' rows are ascending positions in ws
    sums = loads.sum(axis=1)
    in_play = np.ones(k, dtype=bool)
    budget = max(min(_WORK_PER_ITEM * k * m, _WORK_CAP), 4 * k * m)
    while budget > 0:
        play = np.flatnonzero(in_play)
        if len(play) < 2:
            return
        heavy = int(play[np.argmax(sums[play])])
        light = int(play[np.argmin(sums[play])])
        if sums[heavy] - sums[light] <= step:
            return
        budget -= m
        pair = _pair_swap(loads, sums, heavy, light)
        if pair is None:
            budget -= k * m
            pair = _any_swap(loads, sums, heavy, True)
            if pair is None:
                in_play[heavy] = False
                budget -= k * m
                pair = _any_swap(loads, sums, light, False)
                if pair is None:
                    in_play[light] = False
                    continue
        _apply(loads, members, sums, *pair)


def _pair_swap(loads: np.ndarray, sums: np.ndarray, a: int, b: int) -> tuple[int, int, int, int] | None:
    """The exchange between a heavier rank a and a lighter rank b that best evens them.

    Returns:
        (a, i, b, j) to swap loads[a, i] with loads[b, j], or None if no exchange
        narrows their gap.
    """
    gap = sums[a] - sums[b]
    xs, ys = loads[a], loads[b]
    at = np.searchsorted(ys, xs - gap / 2)
    best = None
    for j in (np.maximum(at - 1, 0), np.minimum(at, len(ys) - 1)):
        err = np.abs(2 * (xs - ys[j]) - gap)
        i = int(np.argmin(err))
        if err[i] < gap and (best is None or err[i] < best[0]):  # |2d - gap| < gap <=> 0 < d < gap
            best = (err[i], i, int(j[i]))
    return None if best is None else (a, best[1], b, best[2])


def _any_swap(loads: np.ndarray, sums: np.ndarray, r: int, heavy: bool) -> tuple[int, int, int, int] | None:
    """The exchange of rank r with any other rank that most reduces the sum of squared loads.

    Only exchanges that narrow the two ranks' gap without reversing it are
    considered (so the heaviest load never rises and the lightest never drops).

    Args:
        loads: (k, m) item weights per rank, each row ascending.
        sums: Per-rank loads.
        r: The rank to move.
        heavy: True to trade r's items for smaller ones of lighter ranks, False to
            trade them for larger ones of heavier ranks.

    Returns:
        (a, i, b, j) to swap loads[a, i] (heavier rank) with loads[b, j], or None.
    """
    k, m = loads.shape
    others = np.flatnonzero(sums < sums[r]) if heavy else np.flatnonzero(sums > sums[r])
    if len(others) == 0:
        return None
    gaps = np.abs(sums[r] - sums[others]).astype(np.float64)
    # Rows of the partners laid end to end with offsets, one sorted float array, so a
    # single searchsorted finds each of r's items' best counterpart in every partner.
    lo, hi = float(loads[:, 0].min()), float(loads[:, -1].max())
    span = (hi - lo) + float(gaps.max()) + 1.0
    offsets = np.arange(len(others), dtype=np.float64) * span
    flat = (loads[others].astype(np.float64) + offsets[:, None]).ravel()
    mine = loads[r].astype(np.float64)
    sign = -1.0 if heavy else 1.0  # heavy: want y = x - gap/2; light: want x = y + gap/2
    queries = (mine[None, :] + sign * gaps[:, None] / 2 + offsets[:, None]).ravel()
    at = np.searchsorted(flat, queries)
    row_start = np.repeat(np.arange(len(others)) * m, m)
    own = np.tile(np.arange(m), len(others))
    partner = np.repeat(others, m)
    gap = np.repeat(sums[r] - sums[others], m) * (1 if heavy else -1)
    best_gain, best = None, None
    for pos in (np.clip(at - 1, row_start, row_start + m - 1), np.clip(at, row_start, row_start + m - 1)):
        col = pos - row_start
        theirs = loads[partner, col]
        d = (loads[r, own] - theirs) if heavy else (theirs - loads[r, own])
        gain = np.where((d > 0) & (d < gap), d * (gap - d), 0)  # half the drop in the sum of squares
        t = int(np.argmax(gain))
        if gain[t] > 0 and (best_gain is None or gain[t] > best_gain):
            best_gain = gain[t]
            best = (r, int(own[t]), int(partner[t]), int(col[t])) if heavy else \
                (int(partner[t]), int(col[t]), r, int(own[t]))
    return best


def _apply(loads: np.ndarray, members: np.ndarray, sums: np.ndarray, a: int, i: int, b: int, j: int) -> None:
    """Swap item i of rank a with item j of rank b, keeping both rows sorted."""
    x, y = loads[a, i], loads[b, j]
    ix, iy = members[a, i], members[b, j]
    _replace(loads[a], members[a], i, y, iy)
    _replace(loads[b], members[b], j, x, ix)
    sums[a] -= x - y
    sums[b] += x - y


def _replace(row: np.ndarray, ids: np.ndarray, i: int, value: np.generic, ident: np.generic) -> None:
    """Replace row[i] by value (and ids[i] by ident), keeping row sorted."""
    p = int(np.searchsorted(row, value))
    if p <= i:
        row[p + 1:i + 1] = row[p:i]
        ids[p + 1:i + 1] = ids[p:i]
    else:
        p -= 1
        row[i:p] = row[i + 1:p + 1]
        ids[i:p] = ids[i + 1:p + 1]
    row[p] = value
    ids[p] = ident
