"""Framing shared by every hot-path connection.

    +--------+------------+-------------+----------------------+---------------+
    | "DKD1" | u32 hlen   | u64 blen    | Frame (hlen bytes)   | body (blen)   |
    +--------+------------+-------------+----------------------+---------------+

The Frame is the protobuf message `dockd.v1.Frame`; the body is raw bytes
addressed by the `Value`s inside it. Both ends write a frame as a list of
buffers (prefix+header, then the body's buffers) with vectored I/O and read
bodies straight into their destination memory.

Hot paths take a repeated field of a parsed Frame as a list first
(`req.columns[:]`, one C call) before they loop over it: a loop over the
field itself fetches each item through the sequence protocol and ends by
raising and formatting an IndexError (~2,300 instructions, an empty field
included). On a put of 64 GRPO-shaped samples that was ~75 exceptions, about
6 % of the daemon's instructions (`benchmarks/request_instructions.py`).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockProtocolError

MAGIC = b"DKD1"
PREFIX = struct.Struct("<4sIQ")
# A request header (not a body) this big is a batch to split, or an attack. Headers past the
# receive scratch buffer are counted against one budget per daemon (`dockd.net.peer`).
MAX_HEADER = 64 << 20
# A reply's header may be larger: a request within `dockd.limits` (4M samples in a put, 8M
# sample-columns in a get) is answered in full, never applied and then reported as too big.
# Only a peer that proved it belongs to the dock sends replies.
MAX_REPLY_HEADER = 128 << 20
PROTOCOL_VERSION = 7  # 7: same-host puts sent before their tensor copy (staging_pending); 6: commits coalesced per warehouse; 5: the device tier; 4: rank-aware gets, tags, deletes, checkpoints; 3: columns as runs; 2: answered confirms, tokens, rejoin. Other versions are refused
IOV_MAX = 512


def header(frame: pb.Frame, body_size: int = 0, tail: bytes = b"") -> bytes:
    """The prefix and header of a frame. `tail`: another Frame, serialized, sent after it in the same header,
    which the receiver's parse merges into it (protobuf parses concatenated messages as their merge): a
    part of replies that is the same for many of them, serialized once."""
    raw = frame.SerializeToString()
    size = len(raw) + len(tail)
    if size > MAX_HEADER:  # (read `reply` only then: every field read is a call into protobuf)
        limit = MAX_REPLY_HEADER if frame.reply else MAX_HEADER
        if size > limit:
            raise DockProtocolError(
                f"frame header of {size} bytes exceeds {limit}; split the request into smaller batches"
            )
    return b"".join((PREFIX.pack(MAGIC, size, body_size), raw, tail))


def field(number: int, raw: bytes) -> bytes:
    """Field `number` holding `raw` as a length-delimited value (a message's serialized bytes, a string,
    or a packed repeated integer's varints: an array's `astype(np.uint8).tobytes()` for values below
    128), serialized. Such fields, wrapped in their messages the same way, make a `tail` (see `header`):
    a packed field so costs a few array calls where `extend` makes each value a Python int and converts
    it back (~30 ns each: a get of 64 samples x 4 columns names 256 locations), and a message built
    apart is serialized once where adding it to the frame copies it (serialized and parsed back)."""
    return b"".join((_varint(number << 3 | 2), _varint(len(raw)), raw))


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def parse_prefix(data, offset: int, max_body: int, max_header: int = MAX_HEADER) -> tuple[int, int]:
    """(header length, body length) of the frame starting at data[offset:]; validates both."""
    magic, hlen, blen = PREFIX.unpack_from(data, offset)
    if magic != MAGIC:
        raise DockProtocolError(f"bad frame magic {bytes(magic)!r}: the peer does not speak the dockd protocol")
    if hlen > max_header:
        raise DockProtocolError(f"frame header of {hlen} bytes exceeds the limit of {max_header}")
    if blen > max_body:
        raise DockProtocolError(f"frame body of {blen} bytes exceeds the limit of {max_body} bytes")
    return hlen, blen


def parse_header(data) -> pb.Frame:
    frame = pb.Frame()
    try:
        frame.ParseFromString(bytes(data))
    except Exception as e:  # protobuf raises its own DecodeError
        raise DockProtocolError(f"frame header is not a valid dockd.v1.Frame ({e})") from None
    return frame


def sendall(sock: socket.socket, buffers: Sequence, ancillary: list | None = None) -> None:
    """Write buffers in order with sendmsg (scatter/gather), handling partial writes.

    `ancillary` (descriptors, on Unix sockets) rides on the first sendmsg."""
    bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
    anc = ancillary or []
    while bufs:
        consume(bufs, sock.sendmsg(bufs[:IOV_MAX], anc))
        anc = []


def consume(bufs: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes from a list of buffers after a partial vectored write."""
    k = 0
    while k < len(bufs) and sent >= bufs[k].nbytes:
        sent -= bufs[k].nbytes
        k += 1
    del bufs[:k]
    if sent:
        bufs[0] = bufs[0][sent:]


def check_protocol(theirs: int, who: str) -> None:
    """Refuse a peer that speaks another protocol version, saying what to do."""
    if theirs != PROTOCOL_VERSION:
        raise DockProtocolError(
            f"{who} speaks dockd protocol v{theirs or 1}, this side v{PROTOCOL_VERSION}: run the same dockd "
            "version on every node and client"
        )
