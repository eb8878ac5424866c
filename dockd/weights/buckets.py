"""Bucket plans: named tensors packed into buckets of at most `bucket_size` bytes, and back (pure).

A version of a model travels and is stored as buckets: flat uint8 tensors that
each hold several tensors back to back (every tensor at a 64-byte aligned offset,
so a reader views it in place with any dtype). A tensor larger than a bucket is
split into chunks of whole buckets. Where each tensor (or chunk) lies is a
`Piece`; the list of pieces is the version's index, kept in its manifest.

`Packer` packs tensors as a trainer yields them (one bucket buffer, reused: each
bucket must be consumed before the next is asked for); `Unpacker` turns buckets
back into (name, tensor) as they arrive, in any order, viewing whole tensors in
the bucket and assembling split ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from dockd.errors import DockTypeError, DockValueError

ALIGN = 64
MIN_BUCKET = 4096


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise DockValueError(f"unknown tensor dtype {name!r} in a weights index (written by a newer dockd?)")
    return dt


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """A tensor, or one chunk of a tensor larger than a bucket, at `offset` in bucket `bucket`."""

    name: str
    dtype: str           # torch's name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int          # bytes into the bucket
    nbytes: int          # bytes of this piece
    start: int = 0       # bytes into the tensor where this piece starts (0 unless split)
    total: int = -1      # the tensor's bytes (-1: nbytes, a whole tensor)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.nbytes == self.size

    @property
    def size(self) -> int:
        """The tensor's bytes."""
        return self.nbytes if self.total < 0 else self.total

    def pack(self) -> list[Any]:
        row: list[Any] = [self.name, self.dtype, list(self.shape), self.bucket, self.offset, self.nbytes]
        if not (self.start == 0 and self.total < 0):
            row += [self.start, self.total]
        return row

    @classmethod
    def unpack(cls, row: Sequence[Any]) -> Piece:
        try:
            name, dtype, shape, bucket, offset, nbytes = row[:6]
            start, total = (row[6], row[7]) if len(row) > 6 else (0, -1)
            return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(bucket), int(offset), int(nbytes),
                       int(start), int(total))
        except (TypeError, ValueError) as e:
            raise DockValueError(f"malformed weights index entry {row!r}: {e}") from None


@dataclasses.dataclass(slots=True)
class Bucket:
    index: int
    data: torch.Tensor   # flat uint8 (a view of the packer's buffer: consume it before asking for the next)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (contiguous; on its own device)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class Packer:
    """Packs named tensors into buckets of at most `bucket_size` bytes, in order.

    `add(name, tensor)` yields the buckets the tensor completes, `finish()` the last one;
    `pieces` is the index of everything packed. A tensor that fits a bucket is never split
    (it starts a new bucket when it does not fit the current one); a larger one is cut into
    chunks of `bucket_size` bytes, each starting a bucket."""

    def __init__(self, bucket_size: int) -> None:
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < MIN_BUCKET:
            raise DockValueError(f"bucket_size must be an int of at least {MIN_BUCKET} bytes, got {bucket_size!r}")
        self.bucket_size = bucket_size // ALIGN * ALIGN
        self.pieces: list[Piece] = []
        self.names: set[str] = set()
        self.nbytes = 0  # tensor bytes packed
        self.buckets = 0  # buckets sealed
        self._buf = torch.empty(self.bucket_size, dtype=torch.uint8)
        self._used = 0

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[Bucket]:
        if not isinstance(name, str) or not name:
            raise DockTypeError(f"weight names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise DockTypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in self.names:
            raise DockValueError(f"weight {name!r} is given twice; names must be unique within a version")
        self.names.add(name)
        raw = raw_bytes(tensor)
        total = int(raw.numel())
        shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
        self.nbytes += total
        if total <= self.bucket_size:
            if aligned(self._used) + total > self.bucket_size:
                yield self._seal()
            off = aligned(self._used)
            self._buf[off : off + total].copy_(raw)
            self.pieces.append(Piece(name, dtype, shape, self.buckets, off, total))
            self._used = off + total
            return
        start = 0
        while start < total:
            if self._open():
                yield self._seal()
            n = min(self.bucket_size, total - start)
            self._buf[:n].copy_(raw[start : start + n])
            self.pieces.append(Piece(name, dtype, shape, self.buckets, 0, n, start, total))
            self._used = n
            start += n

    def finish(self) -> Bucket | None:
        """The last bucket (None when nothing is left in it)."""
        return self._seal() if self._open() or not self.buckets else None

    def _open(self) -> bool:
        """Whether the current bucket holds a piece."""
        return bool(self.pieces) and self.pieces[-1].bucket == self.buckets

    def _seal(self) -> Bucket:
        b = Bucket(self.buckets, self._buf[: self._used])
        self.buckets += 1
        self._used = 0
        return b


def pack_all(named: Iterable[tuple[str, torch.Tensor]], bucket_size: int) -> tuple[list[torch.Tensor], list[Piece]]:
    """Every bucket (copied) and the index: for tests and small models."""
    p = Packer(bucket_size)
    out: list[torch.Tensor] = []
    for name, t in named:
        out.extend(b.data.clone() for b in p.add(name, t))
    last = p.finish()
    if last is not None:
        out.append(last.data.clone())
    return out, p.pieces


def view(data: torch.Tensor, piece: Piece) -> torch.Tensor:
    """A whole tensor in a bucket's bytes, viewed in place."""
    raw = data[piece.offset : piece.offset + piece.nbytes]
    dt = dtype_of(piece.dtype)
    if piece.nbytes == 0:
        return torch.empty(piece.shape, dtype=dt, device=data.device)
    return raw.view(dt).view(piece.shape)


class Unpacker:
    """Turns buckets back into (name, tensor), as each arrives (in any order).

    Whole tensors are views of the bucket they came in; split tensors are assembled in memory
    of their own and come out with their last chunk. `done` says every tensor came out."""

    def __init__(self, pieces: Sequence[Piece], buckets: int | None = None) -> None:
        self.pieces = list(pieces)
        self.by_bucket: dict[int, list[Piece]] = {}
        for p in pieces:
            self.by_bucket.setdefault(p.bucket, []).append(p)
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (its bytes so far, bytes missing)
        self._left = len({p.name for p in pieces})
        self.buckets = max(self.by_bucket, default=-1) + 1 if buckets is None else buckets

    @property
    def done(self) -> bool:
        return self._left == 0

    def feed(self, bucket: int, data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        pieces = self.by_bucket.get(bucket, [])
        if not 0 <= bucket < self.buckets:
            raise DockValueError(f"bucket {bucket} is not in this version's index ({self.buckets} buckets)")
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise DockTypeError(f"a bucket is a flat uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
        need = max((p.offset + p.nbytes for p in pieces), default=0)
        if data.numel() < need:
            raise DockValueError(f"bucket {bucket} holds {data.numel()} bytes; its index needs {need}")
        for p in pieces:
            if p.whole:
                self._left -= 1
                yield p.name, view(data, p)
                continue
            held = self._partial.get(p.name)
            if held is None:
                held = (torch.empty(p.size, dtype=torch.uint8, device=data.device), p.size)
            buf, missing = held
            buf[p.start : p.start + p.nbytes].copy_(data[p.offset : p.offset + p.nbytes])
            missing -= p.nbytes
            if missing > 0:
                self._partial[p.name] = (buf, missing)
                continue
            self._partial.pop(p.name, None)
            self._left -= 1
            yield p.name, buf.view(dtype_of(p.dtype)).view(p.shape)
