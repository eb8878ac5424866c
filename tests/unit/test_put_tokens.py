"""The warehouse remembers the outcome of recent puts by their writer token (a re-sent put is
answered with the indexes it got, not stored twice), in little memory per sample."""

from __future__ import annotations

import random
import tracemalloc

from dockd._proto import dockd_pb2 as pb
from dockd.warehouse.put import _Tokens


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
