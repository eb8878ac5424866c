"""The file of one stored put in a data dir (`<n>.put`, see `dockd.warehouse.datadir`): its layout,
its checksums, and reading its header back.

    fixed header   magic "DOCKDPUT", format, JSON header bytes, runs bytes, body bytes (`HEAD`)
    JSON header    the dock, the partition, the group size, the writer's put token; a put answered
                   before its commit (--commit-window) also its block and put id ("block",
                   "put_id"; a file without them was committed before it was written); padded with
                   spaces (format 2 and 3: up to the body, which was written first)
    sums           format 3 only, the last 12 bytes of the JSON header's span: CRC-32s of the
                   fixed and JSON headers, of the runs, of the body (`SUMS`)
    runs           a serialized PutRequest: the partition, the sample indexes, the columns' runs
                   (and the put's tags, for a put answered before its commit: its commit is made
                   again from the file at a restart, `commit.commit_request`)
    body           the put's bytes

Format 3 (written now) checksums every byte of the file: a damaged header is refused like a
damaged body. Formats 1 and 2 (older dockd) are still read: 1 has one CRC-32 of the runs and
the body, 2 one of each, both in the JSON header, which neither covers; a file of any format
must also lie in the directory its partition name hashes to.

A file that fails a check raises `Damaged`, which says what it held when that is still known:
its runs passed a checksum of their own (formats 2 and 3) and name the partition of its dir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from dockd._proto import dockd_pb2 as pb

MAGIC = b"DOCKDPUT"
FORMAT = 3  # 1: one CRC of runs and body; 2: one each, the body written at the end of its room; 3: the headers too
HEAD = struct.Struct("<8sIIIQ")  # magic, format, JSON header bytes (format 3: with the sums), runs bytes, body bytes
SUMS = struct.Struct("<III")  # format 3: CRC-32 of the fixed and JSON headers, of the runs, of the body


def part_dir(partition: str) -> str:
    """The directory of a partition's files in the data dir."""
    return "p-" + hashlib.sha1(partition.encode()).hexdigest()


@dataclasses.dataclass(slots=True, eq=False)
class Room:
    """Disk room taken for a put's file before its commit (`DataDir.room`)."""
    path: str
    size: int                    # bytes allocated: headers and runs first, the body in the last `nbytes`
    nbytes: int
    crc_body: int | None = None  # set once `prewrite` wrote the body there and flushed it
    commit: pb.CommitRequest | None = None  # a put answered before its commit: the commit, kept in its file
    file: str = ""  # the put's file, once written (`DataDir.stored`)


@dataclasses.dataclass(slots=True)
class Held:
    """What a damaged file held, when that is still known: its partition, sample indexes and columns."""
    partition: str
    indexes: np.ndarray
    columns: list[str]


class Damaged(Exception):
    """A put file that fails a check: why, what it held if that is known (else None), and its checked
    JSON header if that is known (whether its put was answered before its commit: "block")."""

    def __init__(self, why: str, held: Held | None = None, meta: dict | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.held = held
        self.meta = meta


@dataclasses.dataclass(slots=True)
class Header:
    """A put file's headers and runs, checked; its body is `blen` bytes at `body_at`, to be checked
    with `check_body`."""
    fmt: int
    meta: dict
    runs: bytes
    req: pb.PutRequest
    body_at: int
    blen: int
    crc_body: int  # format 1: the CRC of the runs and the body

    def held(self) -> Held | None:
        """What the file holds, if its runs passed a checksum of their own (not in format 1)."""
        return None if self.fmt == 1 else _held(self.req)

    def check_body(self, data) -> None:
        crc = zlib.crc32(data, zlib.crc32(self.runs)) if self.fmt == 1 else zlib.crc32(data)
        if crc != self.crc_body:
            raise Damaged("its checksum does not match (the file was damaged after it was written)", self.held(),
                          self.meta)


def encode(meta: dict, runs: bytes, nbytes: int, crc_body: int, body_at: int = 0) -> tuple[list, int] | None:
    """A format 3 file's parts before its body, and its size. With `body_at` (the body is written already,
    there) the JSON header is padded up to it: None when the headers and runs do not fit in front of it."""
    head = json.dumps(meta).encode()
    if body_at:
        pad = body_at - HEAD.size - len(head) - SUMS.size - len(runs)
        if pad < 0:
            return None
        head += b" " * pad
    fixed = HEAD.pack(MAGIC, FORMAT, len(head) + SUMS.size, len(runs), nbytes)
    sums = SUMS.pack(zlib.crc32(head, zlib.crc32(fixed)), zlib.crc32(runs), crc_body)
    return [fixed, head, sums, runs], HEAD.size + len(head) + SUMS.size + len(runs) + nbytes


def open_regular(path: str) -> int:
    """A read-only descriptor of `path` if it is a regular file (never blocking on a fifo or a device, never
    following a link); Damaged otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        kind = "a symbolic link" if os.path.islink(path) else f"unreadable ({e.strerror or e})"
        raise Damaged(f"it is {kind}, not a stored put's regular file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a fifo" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise Damaged(f"it is {kind}, not a stored put's regular file")
    return fd


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def read_header(fd: int, dir_name: str) -> Header:
    """Read and check a put file's headers and runs (its body is checked as it is read: `check_body`);
    `dir_name`: the partition dir it lies in."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, HEAD.size, 0)
    if len(head) < HEAD.size:
        raise Damaged("its header is cut short")
    magic, fmt, hlen, rlen, blen = HEAD.unpack(head)
    if magic != MAGIC or fmt not in (1, 2, FORMAT):
        raise Damaged("it is not a dockd stored put of this version")
    body_at = HEAD.size + hlen + rlen
    if fmt == FORMAT:
        if hlen < SUMS.size or body_at > size:
            raise Damaged("its size does not match its header")
        span = os.pread(fd, hlen, HEAD.size)
        crc_head, crc_runs, crc_body = SUMS.unpack_from(span, hlen - SUMS.size)
        runs = os.pread(fd, rlen, body_at - rlen)
        req = _runs(runs, crc_runs, dir_name)
        if zlib.crc32(span[: hlen - SUMS.size], zlib.crc32(head)) != crc_head:
            raise Damaged("the checksum of its header does not match (the file was damaged after it was written)",
                          _held(req) if req is not None else None)
        if req is None:
            raise Damaged("the checksum of its runs does not match (the file was damaged after it was written)")
        if size != body_at + blen:
            raise Damaged("its size does not match its header", _held(req))
        meta = _json(span[: hlen - SUMS.size])
    else:  # formats 1 and 2: the JSON header holds the checksums and is not covered by them
        if size != body_at + blen:
            raise Damaged("its size does not match its header")
        meta = _json(os.pread(fd, hlen, HEAD.size))
        runs = os.pread(fd, rlen, HEAD.size + hlen)
        try:  # format 1: "crc" covers the runs and the body; format 2: the runs, and "crc_body" the body
            crc_runs, crc_body = int(meta["crc"]), int(meta["crc" if fmt == 1 else "crc_body"])
        except (KeyError, TypeError, ValueError):
            raise Damaged("its header cannot be read") from None
        req = _runs(runs, crc_runs if fmt == 2 else None, dir_name)
        if req is None:
            raise Damaged("the checksum of its runs does not match (the file was damaged after it was written)")
    h = Header(fmt, meta, runs, req, body_at, blen, crc_body)
    if meta.get("partition") != req.partition or not isinstance(meta.get("group_size"), int):
        raise Damaged("its header does not match its runs (the file was damaged after it was written)", h.held())
    return h


def _json(raw: bytes) -> dict:
    try:
        meta = json.loads(raw)
    except ValueError:
        raise Damaged("its header cannot be read") from None
    if not isinstance(meta, dict):
        raise Damaged("its header cannot be read")
    return meta


def _runs(raw: bytes, crc: int | None, dir_name: str) -> pb.PutRequest | None:
    """The runs, parsed, if they pass their checksum (`crc`; None: format 1, checked with the body) and
    name the partition of the dir they lie in; None when their checksum fails."""
    if crc is not None and zlib.crc32(raw) != crc:
        return None
    try:
        req = pb.PutRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, or worse: the bytes are not runs
        raise Damaged("its runs cannot be read") from None
    if part_dir(req.partition) != dir_name:
        raise Damaged(f"the partition it names ({req.partition!r}) is not that of its directory (the file was "
                      "damaged after it was written, or moved)")
    return req


def _held(req: pb.PutRequest) -> Held:
    return Held(req.partition, np.asarray(req.indexes, dtype=np.int64), [c.name for c in req.columns])


def columns_of(held: Sequence[Held]) -> dict[str, dict[str, np.ndarray]]:
    """What damaged files held, by partition and column (sorted unique indexes)."""
    out: dict[str, dict[str, list[np.ndarray]]] = {}
    for h in held:
        for c in h.columns:
            out.setdefault(h.partition, {}).setdefault(c, []).append(h.indexes)
    return {p: {c: np.unique(np.concatenate(ix)) for c, ix in cols.items()} for p, cols in out.items()}
