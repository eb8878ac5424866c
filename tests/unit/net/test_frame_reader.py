"""Reading frames (`dockd.net.frame_reader.FrameReader`), driven directly: bytes handed in the way an
asyncio transport hands them (`get_buffer` / `buffer_updated`), in any pieces, on a running loop, to
a reader whose subclass records what it was given. No socket."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull, DockProtocolError
from dockd.net import wire
from dockd.net.frame_reader import _SCRATCH, RATE_GRACE, FrameReader, too_slow


class Paused:
    """What a reader asks of its transport while a body is held back."""

    def __init__(self) -> None:
        self.paused = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.paused -= 1


class Recorder(FrameReader):
    def __init__(self, admit=None, **kw) -> None:
        super().__init__(max_body=1 << 30, max_header=wire.MAX_HEADER, **kw)
        self.role = "client"
        self.transport = Paused()
        self.admit, self.frames, self.rejected, self.failed, self.abandoned = admit, [], [], [], []

    def _dispatch(self, frame, body):
        self.frames.append((frame, None if body is None else bytes(memoryview(body).cast("B")), self._frame_fds))
        self._frame_fds = []

    def _admit(self, frame, body_size):
        return self.admit(frame, body_size) if self.admit is not None else None

    def _allocate(self, size):
        return pa.allocate_buffer(size)

    def _abandoned(self, frame, body_size):
        self.abandoned.append(frame.id)

    def _rejected(self, frame, exc):
        self.rejected.append((frame.id, exc))

    def fail(self, exc):
        self.failed.append(exc)
        self.closed = True

    def feed(self, data: bytes, piece: int = 1 << 30) -> None:
        """Hand `data` in as a transport would, at most `piece` bytes a read."""
        mv = memoryview(data)
        while mv:
            dst = self.get_buffer(-1)
            n = min(len(dst), len(mv), piece)
            dst[:n] = mv[:n]
            mv = mv[n:]
            self.buffer_updated(n)


def frame(fid: int, body: bytes = b"", **fields) -> bytes:
    return wire.header(pb.Frame(id=fid, **fields), len(body)) + body


def run(coro):
    return asyncio.run(coro)


def test_frames_in_any_pieces_come_out_whole_and_in_order_each_body_in_its_own_buffer():
    async def main():
        r = Recorder()
        stream = frame(1, hello=pb.Hello()) + frame(2, b"x" * 100_000, put=pb.PutRequest(partition="p")) + frame(3)
        r.feed(stream, piece=7)
        return r

    r = run(main())
    assert [f.id for f, _, _ in r.frames] == [1, 2, 3] and not r.failed
    assert r.frames[1][1] == b"x" * 100_000 and r.frames[0][1] is None
    assert not r.mid_frame() and len(r._buf) == _SCRATCH


def test_a_body_held_back_pauses_reading_and_a_rejected_one_is_read_and_answered_with_the_error():
    async def main():
        gate: asyncio.Future = asyncio.get_running_loop().create_future()
        r = Recorder(admit=lambda f, n: gate)
        r.feed(frame(1, b"a" * 5000, put=pb.PutRequest()) + frame(2, hello=pb.Hello()))
        assert r.transport.paused == 1 and not r.frames and r.frame_fault(1e9) is None  # (held back: not late)
        gate.set_exception(DockFull("no room"))
        await asyncio.sleep(0)
        return r

    r = run(main())
    assert r.transport.paused == 0 and [(i, type(e)) for i, e in r.rejected] == [(1, DockFull)]
    assert [f.id for f, _, _ in r.frames] == [2]  # the frame after the dropped body is read


def test_only_small_bodiless_frames_before_authentication():
    async def main():
        r = Recorder()
        r.role = None
        r.feed(frame(1, b"x", put=pb.PutRequest()))
        return r

    (err,) = run(main()).failed
    assert "authenticate first" in str(err)


def test_a_large_header_grows_the_buffer_with_what_arrived_within_the_process_budget():
    async def main():
        r = Recorder()
        r.header_budget = 1 << 20
        before = FrameReader.header_held
        raw = wire.header(pb.Frame(id=1, put=pb.PutRequest(partition="p" * (2 << 20))))
        r.feed(raw[:64])  # a prefix announcing 2 MiB: the buffer grows with what arrived, not to 2 MiB
        assert len(r._buf) <= 2 * _SCRATCH and not r.failed
        with pytest.raises(DockProtocolError, match="large request headers .*at most 1 MiB"):
            r.feed(raw[64:])  # (the transport closes a connection whose get_buffer raised)
        assert FrameReader.header_held > before
        r._stop_reading()  # (the connection's end gives its room back)
        return before

    assert FrameReader.header_held == run(main())


def test_descriptors_are_claimed_by_the_frame_that_announces_them_and_closed_when_the_connection_ends():
    import os

    async def main():
        r = Recorder()
        a, b = os.pipe()
        r.fds_received([a, b])
        assert FrameReader.fds_held >= 2
        r.feed(frame(1, fds=1))
        (_, _, fds), = r.frames
        assert fds == [a]
        os.close(a)
        r._stop_reading()  # b was never claimed: closed with the connection
        with pytest.raises(OSError):
            os.fstat(b)

    run(main())


def test_a_frame_that_stalls_or_crawls_is_at_fault():
    async def main():
        r = Recorder()
        r.feed(frame(1, b"x" * 1000, put=pb.PutRequest())[:500])
        now = asyncio.get_running_loop().time()
        assert r.mid_frame() and r.frame_fault(now) is None
        assert "stalled" in str(r.frame_fault(now + r.stall_timeout + 1))
        r._last = now + RATE_GRACE + 5  # (bytes keep coming, far too slowly)
        assert "bytes/s" in str(r.frame_fault(now + RATE_GRACE + 5))

    run(main())


def test_a_frame_at_exactly_the_minimum_rate_is_not_cut():
    rate = 64 << 10
    assert not too_slow(int(rate * 100), 100.0, rate)      # exactly --min-rate: received to its end
    assert too_slow(int(rate * 100) - 1, 100.0, rate)      # a byte under: cut
    assert not too_slow(0, RATE_GRACE, rate)               # nothing is checked within the grace


def test_a_body_cut_off_by_the_connections_end_gives_its_admission_back():
    async def main():
        r = Recorder()
        r.feed(frame(4, b"y" * 10_000, put=pb.PutRequest())[:3000])
        r._stop_reading()
        return r

    r = run(main())
    assert r.abandoned == [4] and not r.frames


def test_a_protocol_error_in_the_stream_fails_the_connection_not_the_reader():
    async def main():
        r = Recorder()
        r.feed(b"XXXX" + bytes(12))
        return r

    (err,) = run(main()).failed
    assert isinstance(err, DockProtocolError) and "magic" in str(err)
