"""A put's or reply's body: buffers laid out back to back, each run at an ALIGN-byte offset (`Body`),
with per-sample tensors concatenated only when the body is written (`Joined`, `cat_into`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dockd._lazy import lazy_torch
from dockd.codec import dtypes

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_torch(globals(), on_load=dtypes.loaded)

ALIGN = 64
_PAD = bytes(ALIGN)
# torch's grain size: a concatenation into fewer elements than this copies its inputs one memcpy each on the
# calling thread; into more (with several intra-op threads) each input goes through a generic copy, 1.5-2x
# slower for 64 per-sample tensors of ~1,000 elements. `cat_into` concatenates in chunks below it, unless
# torch runs one intra-op thread: then every concatenation is serial, and one call costs less than several.
_SERIAL_CAT = 32768


def cat_into(tensors: list[torch.Tensor], lengths: Sequence[int], out: torch.Tensor) -> None:
    """Concatenate flat CPU tensors of `out`'s dtype with `lengths` elements each into `out`
    (1-D, sum(lengths) elements), in chunks of fewer than _SERIAL_CAT elements (torch's memcpy path) when
    torch runs several intra-op threads. A tensor of more elements goes alone."""
    with torch.no_grad():
        if torch.get_num_threads() == 1:
            torch.cat(tensors, out=out)
            return
        start = pos = acc = 0
        for i, n in enumerate(lengths):
            if acc and acc + n >= _SERIAL_CAT:
                torch.cat(tensors[start:i], out=out[pos : pos + acc])
                start, pos, acc = i, pos + acc, 0
            acc += n
        torch.cat(tensors[start:], out=out[pos : pos + acc])


class Joined:
    """Per-sample 1-D CPU tensors of one dtype whose bytes go back to back in a body. They are
    concatenated only when the body is written: straight into the destination when it is a
    staging buffer (`Body.write_into`, the put's one copy), else once, when the bytes are read."""

    __slots__ = ("tensors", "lengths", "dtype", "nbytes", "_view")

    def __init__(self, tensors: list, lengths: list[int], dtype, nbytes: int) -> None:
        self.tensors, self.lengths, self.dtype, self.nbytes = tensors, lengths, dtype, nbytes
        self._view: memoryview | None = None

    def view(self) -> memoryview:
        if self._view is None:
            out = torch.empty(sum(self.lengths), dtype=self.dtype)
            cat_into(self.tensors, self.lengths, out)
            self._view = as_bytes(out)
        return self._view

    def write_into(self, dst: memoryview) -> None:
        if self._view is not None:
            dst[:] = self._view
            return
        cat_into(self.tensors, self.lengths, torch.frombuffer(dst, dtype=torch.uint8).view(self.dtype))


class Body:
    """Buffers laid out back to back, each run starting at an ALIGN-byte offset; kept as a
    list (no concatenation), written with vectored I/O or into one buffer (`write_into`).

    A part added with `checked=True` is one the warehouse's checks read (msgpack values): a same-host
    put sent before its tensors are copied into the staging buffer (`late`) has those parts written
    first (`write_into(dst, late=False)`), and the others right after the send (`write_late_into`)."""

    __slots__ = ("_parts", "size", "_joined", "_joins", "_checked", "_late")

    def __init__(self) -> None:
        self._parts: list[memoryview | bytes | Joined] = []
        self.size = 0
        self._joined = False  # a part is a Joined (not concatenated yet)
        self._joins = False  # a part was added as a Joined
        self._checked: set[int] = set()  # positions in _parts of the parts added checked
        self._late = 0  # parts the warehouse's checks do not read

    @property
    def late(self) -> bool:
        """Whether a same-host put is sent before the parts its warehouse's checks do not read are
        written into the staging buffer, so that their copy runs while the warehouse checks the put:
        when it has per-sample tensors to join (`Joined`) or several such parts. A put of one tensor
        leaves the warehouse little to check meanwhile, and the signal that the copy is done then costs
        about what the overlap gains (benchmarks/README.md, 2026-12-07)."""
        return self._joins or self._late > 1

    def add(self, *parts: memoryview | Joined, checked: bool = False) -> int:
        """Append parts contiguously at the next aligned offset; returns that offset."""
        pad = -self.size % ALIGN
        if pad:
            self._parts.append(_PAD[:pad])
            self.size += pad
        off = self.size
        for data in parts:
            if data.nbytes:
                self._append(data, checked)
        return off

    def extend(self, data: memoryview) -> None:
        """Append `data` right after the last part (no padding: it continues the run that part is in)."""
        if data.nbytes:
            self._append(data, len(self._parts) - 1 in self._checked)

    def _append(self, data: memoryview | Joined, checked: bool) -> None:
        if checked:
            self._checked.add(len(self._parts))
        else:
            self._late += 1
        if type(data) is Joined:
            self._joined = self._joins = True
        self._parts.append(data)
        self.size += data.nbytes

    @property
    def buffers(self) -> list[memoryview | bytes]:
        """The body as buffers (values still to be concatenated are, now)."""
        if self._joined:
            self._parts = [p.view() if isinstance(p, Joined) else p for p in self._parts]
            self._joined = False
        return self._parts  # type: ignore[return-value]  # (none is a Joined any more)

    def write_into(self, dst: memoryview, *, late: bool = True) -> None:
        """Write the whole body into `dst` (at least `size` bytes, byte-addressed); `late=False`: only
        the parts added with checked=True, the others left for `write_late_into`."""
        self._write(dst, None if late else True)

    def write_late_into(self, dst: memoryview) -> None:
        """Write the parts `write_into(dst, late=False)` left out, where their room is."""
        self._write(dst, False)

    def _write(self, dst: memoryview, checked: bool | None) -> None:
        """Each part into `dst` at its offset: every part (None), or those added checked or not."""
        off = 0
        for i, p in enumerate(self._parts):
            n = len(p) if isinstance(p, bytes) else p.nbytes
            if checked is None or (i in self._checked) == checked:
                if isinstance(p, Joined):
                    p.write_into(dst[off : off + n])
                else:
                    dst[off : off + n] = memoryview(p).cast("B")
            off += n


_NO_NUMPY = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # (dtypes numpy lacks: viewed as bytes by torch)


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor. (Flattened first: a contiguous tensor's size-1 last dimension
    may have any stride, e.g. a transposed (1, n), and viewing it as bytes as it is would fail.) Viewed by
    numpy where it has the dtype: a third of torch's reshape and view (~0.8 against 2.2 us, per run)."""
    if not t.numel():
        return memoryview(b"")
    # (an ndarray is a buffer; numpy's stubs declare its __buffer__ only for Python >= 3.12)
    if dtypes.NAMES.get(t.dtype) not in _NO_NUMPY:
        try:
            a = t.numpy()
        except (TypeError, RuntimeError):  # (a numpy without the dtype; a tensor that requires grad)
            pass
        else:
            return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
