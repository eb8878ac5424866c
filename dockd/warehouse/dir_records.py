"""The records a data dir's partition dir keeps beside its put files (`dockd.warehouse.datadir`), and how
they stay bounded: `deleted` (int64 indexes of samples deleted while the rest of their put lives) and
`committed` (int64 numbers of its files of puts answered before their commit whose commit was answered).

Both are appended to as the warehouse runs, and both are rewritten with only what still matters (the
samples, or the numbers, of put files still there) at start and once they are big and mostly stale: a
long stream of puts consumed and deleted keeps them at the size of what the dir holds, not of all it ever
held. A rewrite goes to a temporary file, fsync'd, then renamed over the record: a kill (or a power cut)
at any point leaves the old record or the new one, never a torn one. The old one only lists more
(samples, or numbers, of files gone): a start reads it as the new one."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from dockd.warehouse import putfile


@dataclasses.dataclass(slots=True)
class Deletes:
    """A partition dir's put files still there (their samples) and its `deleted` record's size."""

    files: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # put file -> its sample indexes
    samples: int = 0  # samples those files hold
    records: int = 0  # indexes its `deleted` record holds
    kept: int = 0  # ... of which its last rewrite kept

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


def read(path: str) -> np.ndarray:
    """The int64 records of file `path` (a torn last record left out); FileNotFoundError when there is none,
    `putfile.Damaged` when it is not a regular file (opened as put files are: never blocking on a fifo)."""
    fd = putfile.open_regular(path)
    try:
        raw = putfile.read_all(fd)
    finally:
        os.close(fd)
    return np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<i8")


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
            data = memoryview(np.ascontiguousarray(values, dtype="<i8").tobytes())
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
