"""The records a data dir's partition dir keeps beside its put files (`dockd.warehouse.datadir`), and how
they stay bounded: `deleted` (indexes of samples deleted while the rest of their put lives) and
`committed` (numbers of its files of puts answered before their commit whose commit was answered).

Format: an 8-byte header (`MAGIC`), then 16-byte entries: the int64 value and a 64-bit check of it. A torn
last entry is left out, and so is an entry whose check fails (a corrupted sector, a zeroed page): a
`committed` entry left out only makes a restart send that commit again (answered as applied), a
`deleted` one only lets a restart read the sample back, which its controller frees again (it records
the delete, and never hands a deleted index out again). So no corruption can make an unsent commit look
sent, nor free a sample nobody deleted. A file without the header is of the format before (bare int64
values: read as they are, and rewritten in this format at the next start).

Both are appended to as the warehouse runs (`append`: a write that fails, a full disk, is cut back off,
so the next append never follows half an entry), and both are rewritten with only what still matters
(the samples, or the numbers, of put files still there) at start and once they are big and mostly stale:
a long stream of puts consumed and deleted keeps them at the size of what the dir holds, not of all it
ever held. A rewrite goes to a temporary file, fsync'd, then renamed over the record: a kill (or a power
cut) at any point leaves the old record or the new one, never a torn one. The old one only lists more
(samples, or numbers, of files gone): a start reads it as the new one."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import struct

import numpy as np

from dockd.warehouse import putfile

logger = logging.getLogger(__name__)

MAGIC = b"dockrec\xb1"  # (as an int64 a negative number: never a value of the format before)
ENTRY = 16  # bytes an entry takes: its value, its check
_checked: set[str] = set()  # records this process appended to: their header is this format's (a new file gets one)
_SALT = np.uint64(0x6B1D_93C7_2F0E_A5D1)


@dataclasses.dataclass(slots=True)
class Deletes:
    """A partition dir's put files still there (their samples) and its `deleted` record's size."""

    files: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # put file -> its sample indexes
    samples: int = 0  # samples those files hold
    records: int = 0  # indexes its `deleted` record holds
    kept: int = 0  # ... of which its last rewrite kept
    unrecorded: list[np.ndarray] = dataclasses.field(default_factory=list)  # deletes a full disk kept out of it

    def hold(self, path: str, idx: np.ndarray) -> None:
        self.files[path] = np.array(idx, dtype=np.int64)  # (a copy: not a view of a request's buffer)
        self.samples += len(self.files[path])

    def drop(self, path: str) -> None:
        idx = self.files.pop(path, None)
        if idx is not None:
            self.samples -= len(idx)

    def appended(self, n: int, at: int) -> bool:
        """`n` indexes appended to the record; whether it is now due for a rewrite: it holds more than `at`,
        more than twice what its last rewrite kept, and more than the samples its files hold (so a rewrite,
        which costs as much as those, comes once per as many deletes at least)."""
        self.records += n
        return self.records > max(at, 2 * self.kept, self.samples)

    def live(self, recorded: np.ndarray) -> np.ndarray:
        """The indexes of `recorded` that a put file still there holds (sorted, once each)."""
        if not self.files or not len(recorded):
            return np.empty(0, dtype="<i8")
        held = np.concatenate(list(self.files.values()))
        return np.unique(recorded[np.isin(recorded, held)]).astype("<i8")


def _check(values: np.ndarray) -> np.ndarray:
    """The check of each value: a 64-bit mix of it (splitmix64's finalizer), so that a flipped bit, a zeroed
    entry or an entry made of two halves of others fails."""
    with np.errstate(over="ignore"):
        z = values.astype("<i8").view(np.uint64) ^ _SALT
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_M64 = (1 << 64) - 1
_ENTRY = struct.Struct("<qQ")


def _check1(v: int) -> int:
    """`_check` of one value, in Python ints (a few values are appended at a time: numpy costs more there)."""
    z = (v & _M64) ^ int(_SALT)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def encode(values: np.ndarray) -> bytes:
    """Entries of `values` (no header)."""
    if len(values) <= 8:
        return b"".join(_ENTRY.pack(v, _check1(v)) for v in map(int, values))
    out = np.empty((len(values), 2), dtype="<u8")
    out[:, 0] = np.asarray(values, dtype="<i8").view(np.uint64)
    out[:, 1] = _check(np.asarray(values, dtype="<i8"))
    return out.tobytes()


def decode(raw: bytes, path: str = "") -> np.ndarray:
    """The int64 values of a record's bytes (header included): a torn last entry, and entries whose check
    fails (logged, naming `path`), left out; bytes without the header are the format before."""
    if raw[: len(MAGIC)] != MAGIC:
        if len(raw) < 8:  # (a header torn at its first write: nothing was recorded)
            return np.empty(0, dtype="<i8")
        return np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<i8")
    body = raw[len(MAGIC):]
    ent = np.frombuffer(body[: len(body) // ENTRY * ENTRY], dtype="<u8").reshape(-1, 2)
    values = ent[:, 0].view("<i8")
    ok = _check(values) == ent[:, 1]
    if not ok.all():
        logger.warning("[datadir] %s: %d of its %d entries fail their check (a damaged disk?) and are left out: "
                       "a commit of those is sent again, a delete of those made again by the controller",
                       path, int((~ok).sum()), len(ok))
        values = values[ok]
    return values


def read(path: str) -> np.ndarray:
    """The values of record `path` (see `decode`); FileNotFoundError when there is none, `putfile.Damaged`
    when it is not a regular file (opened as put files are: never blocking on a fifo)."""
    fd = putfile.open_regular(path)
    try:
        raw = putfile.read_all(fd)
    finally:
        os.close(fd)
    return decode(raw, path)


def append(path: str, values: np.ndarray) -> None:
    """Append `values` to record `path` (made if need be; FileNotFoundError when its dir is gone). Not
    fsync'd: a record lost to a power cut only lists less (see the module docstring). A write that fails
    (OSError: a full disk) is cut back off; a record of the format before is rewritten in this one first."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        size = os.fstat(fd).st_size
        head = MAGIC if path in _checked or not size else os.pread(fd, len(MAGIC), 0)
        if size and head != MAGIC:
            if size >= 8:  # the format before: rewritten whole, with these
                os.close(fd)
                fd = -1
                replace(path, np.concatenate([read(path), np.asarray(values, dtype="<i8")]))
                return
            os.ftruncate(fd, 0)  # (a header torn at its first write: nothing was recorded)
            size = 0
        elif size and (torn := (size - len(MAGIC)) % ENTRY):  # (an entry torn by a power cut: cut off, never
            os.ftruncate(fd, size - torn)                      # followed by a whole one)
            size -= torn
        data = memoryview((b"" if size else MAGIC) + encode(values))
        try:
            while len(data):
                data = data[os.write(fd, data):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
        if len(_checked) >= 4096:  # (partitions come and go: a path forgotten is only read once more)
            _checked.clear()
        _checked.add(path)
    finally:
        if fd >= 0:
            os.close(fd)


def not_recorded(path: str, e: OSError, count: int, what: str, then: str) -> None:
    """Log that `what` could not be appended to record `path`, and what `then` comes of it (the first time,
    then every 10,000th)."""
    if count == 1 or count % 10000 == 0:
        d = os.path.dirname(path)
        free = shutil.disk_usage(d).free if os.path.isdir(d) else 0
        logger.warning("[datadir] could not record %s in %s (%s; %d bytes free there; %d such records so far): %s. "
                       "Free room on that disk", what, path, e.strerror or e, free, count, then)


def replace(path: str, values: np.ndarray) -> None:
    """Replace record `path` by `values` whole (none: no record): written to a temporary file, fsync'd,
    then renamed over it. A dir gone (its partition cleared) is nothing to do."""
    if not len(values):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.new")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return
    try:
        try:
            data = memoryview(MAGIC + encode(np.asarray(values)))
            while len(data):
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
