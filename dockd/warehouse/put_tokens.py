"""The outcomes of recent puts by their writer's token (`Tokens`): a put re-sent with a token already
seen (the writer lost the reply) is answered with the first attempt's outcome and stored nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.net.peer import Peer
from dockd.recent import Recent

PUT_TOKENS_KEPT = 4096
PUT_TOKENS_CELLS = 1 << 22  # explicit indexes those outcomes hold at most (32 MiB; see dockd.recent)


class Tokens:
    """Put tokens seen: the outcome of the last PUT_TOKENS_KEPT puts, and the retries waiting on running ones."""

    def __init__(self) -> None:
        # token -> the indexes it got (see _kept)
        self._done: Recent[Sequence[int] | np.ndarray] = Recent(PUT_TOKENS_KEPT, PUT_TOKENS_CELLS)
        self._running: dict[int, list[tuple[Peer, pb.Frame]]] = {}  # token -> retries waiting on it

    def again(self, peer: Peer, frame: pb.Frame, drop: Callable[[], None]) -> bool:
        """Whether this put was seen (then `drop` its room, answer it or queue it behind its first
        attempt, and store nothing); else it runs from now."""
        tok = frame.put.token
        done = self._done.get(tok)
        waiting = self._running.get(tok)
        if done is None and waiting is None:
            self._running[tok] = []
            return False
        drop()
        if done is not None:
            indexes = done.tolist() if isinstance(done, np.ndarray) else list(done)
            peer.reply(frame, pb.Frame(put_reply=pb.PutReply(indexes=indexes)))
        else:
            assert waiting is not None  # (seen: done, or still running)
            waiting.append((peer, frame))
        return True

    def done(self, token: int, indexes: list[int] | None, exc: BaseException | None = None) -> None:
        """Answer the retries that waited on a put's first attempt, and remember its outcome."""
        if not token:
            return
        for peer, frame in self._running.pop(token, ()):
            if exc is not None:
                peer.reply_error(frame, exc)
            else:
                peer.reply(frame, pb.Frame(put_reply=pb.PutReply(indexes=indexes)))
        if exc is None:
            assert indexes is not None  # (a put that succeeded has its indexes)
            self._done.add(token, _kept(indexes))


def _kept(indexes: Sequence[int]) -> Sequence[int] | np.ndarray:
    """A put's indexes as remembered for its re-sends: a range when they are consecutive (a put of
    new samples), else 8 bytes each. As the list of Python ints the answer is built from, the last
    PUT_TOKENS_KEPT puts of 1,000 samples held 36 bytes per sample, more than the warehouse's
    whole index of them."""
    if len(indexes) <= 2:
        return tuple(indexes)
    first = indexes[0]
    if indexes[-1] - first == len(indexes) - 1:
        idx = np.asarray(indexes, dtype=np.int64)
        if bool((idx[1:] - idx[:-1] == 1).all()):
            return range(first, first + len(indexes))
        return idx
    return np.asarray(indexes, dtype=np.int64)
