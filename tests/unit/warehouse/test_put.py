"""The warehouse remembers the outcome of recent puts by their writer token (a re-sent put is
answered with the indexes it got, not stored twice), in little memory per sample."""

from __future__ import annotations

import random
import tracemalloc

from dockd._proto import dockd_pb2 as pb
from dockd.warehouse.put_tokens import Tokens as _Tokens


class _Peer:
    def __init__(self) -> None:
        self.replies: list[pb.Frame] = []

    def reply(self, request: pb.Frame, frame: pb.Frame) -> None:
        self.replies.append(frame)


def _resent(tokens: _Tokens, token: int) -> list[int]:
    peer, dropped = _Peer(), []
    assert tokens.again(peer, pb.Frame(put=pb.PutRequest(token=token)), lambda: dropped.append(1))  # type: ignore[arg-type]
    assert dropped == [1]  # its room goes back: nothing is stored again
    return list(peer.replies[-1].put_reply.indexes)


def test_a_re_sent_put_is_answered_with_the_indexes_its_first_attempt_got():
    shuffled = list(range(5000, 6000))
    random.Random(0).shuffle(shuffled)
    cases = {1: list(range(1000, 2000)), 2: shuffled, 3: [7], 4: [], 5: [3, 4, 6, 7], 6: [9, 8, 7]}
    tokens = _Tokens()
    for token, indexes in cases.items():
        assert not tokens.again(_Peer(), pb.Frame(put=pb.PutRequest(token=token)), lambda: None)  # type: ignore[arg-type]
        tokens.done(token, indexes)
    for token, indexes in cases.items():
        assert _resent(tokens, token) == indexes


def test_remembered_puts_hold_at_most_8_bytes_per_sample():
    """The answer's list of Python ints, kept as it was, held 36 bytes per sample (4,096 puts of 1,000
    samples: 147 MB): consecutive indexes (a put of new samples) are kept as a range, others 8 bytes each."""
    tokens = _Tokens()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(200):
            tokens.done(k + 1, list(range(1000 * k, 1000 * (k + 1))))
        consecutive = tracemalloc.get_traced_memory()[0] - before
        for k in range(200, 400):
            tokens.done(k + 1, list(range(1000 * k, 1000 * (k + 1), 2)) + list(range(1000 * k + 1, 1000 * (k + 1), 2)))
        other = tracemalloc.get_traced_memory()[0] - before - consecutive
    finally:
        tracemalloc.stop()
    assert consecutive < 200 * 400  # (a range and the dict's entry: ~250 bytes a put)
    assert other < 200 * (8 * 1000 + 400)


def test_remembered_explicit_indexes_are_bounded_in_total_not_only_in_number():
    """A client writing a column of a million existing samples (explicit indexes), then clearing them, made
    every remembered put hold 8 bytes per index; the warehouse's last 4,096 puts, the controller's last
    4,096 commits per warehouse and 16,384 writer tokens could hold tens of GB. They are bounded in
    indexes too now; puts of new samples (ranges) cost nothing and stay."""
    import numpy as np

    from dockd.recent import Recent
    from dockd.warehouse.put_tokens import PUT_TOKENS_CELLS, PUT_TOKENS_KEPT

    tokens = _Tokens()
    shuffled = np.random.default_rng(0).permutation(1 << 20).tolist()
    for k in range(12):
        tokens.done(k + 1, shuffled)
    tokens.done(100, list(range(7, 7 + (1 << 20))))  # new samples: a range
    kept = tokens._done
    assert kept.held <= PUT_TOKENS_CELLS and len(kept) == PUT_TOKENS_CELLS // (1 << 20) + 1
    assert _resent(tokens, 100) == list(range(7, 7 + (1 << 20))) and _resent(tokens, 12) == shuffled
    assert 1 not in kept  # the oldest went first
    r: Recent[object] = Recent(count=3, cells=10)
    r.add("a", np.arange(4))
    r.add("b", range(1000))
    r.add("c", np.arange(8))  # 12 cells: "a" goes
    assert list(r) == ["b", "c"] and r.held == 8
    r.add("d", np.arange(50))  # alone past the bound: the newest always stays
    assert list(r) == ["d"] and r.held == 50
    for k in range(5):
        r.add(k, range(k))
    assert list(r) == [2, 3, 4] and r.held == 0 and PUT_TOKENS_KEPT == 4096


def test_a_snapshot_keeps_commits_of_new_samples_as_ranges(tmp_path):
    """A snapshot wrote every remembered commit as its indexes (8 bytes each, even for a range): 4,096
    puts of 100k new samples were 3.2 GB per warehouse in it, and as much memory after a restart."""
    from dockd.controller.core import Controller

    c = Controller()
    for k in range(3):
        c.commit("p", ["x"], warehouse=1, new_count=100_000, put_id=k + 1)
    c.commit("p", ["y"], warehouse=1, indexes=[5, 3, 9], put_id=9)
    snap = c.snapshot(0.0)
    back = Controller.restore(snap, wall_offset=0.0)
    kept = back.put_keys[1]
    assert [kept.get(k + 1) for k in range(3)] == [range(0, 100_000), range(100_000, 200_000), range(200_000, 300_000)]
    assert kept.get(9).tolist() == [5, 3, 9]
    assert back.catalog.recall(1, 2).tolist() == list(range(100_000, 200_000))
    import msgpack

    assert len(msgpack.packb(snap["put_keys"], use_bin_type=True)) < 200
