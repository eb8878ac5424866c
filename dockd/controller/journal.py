"""The controller's state dir: a snapshot plus an append-only journal of decisions.

    STATE_DIR/
      lock                     held (flock) by the controller using the dir, its pid written in it
      snapshot-<gen>.msgpack   the whole controller at one moment (Controller.snapshot)
      journal-<gen>.log        every decision made since that snapshot, in order

One controller per state dir: the daemon locks it (`lock`, `dockd.dirlock`) before reading it, and
a second one refuses to start, naming the holder's pid (two controllers on one dir each rebuilt
from, and compacted away, the other's records).

A record is `u32 length | u32 crc32 | msgpack list`. Recovery loads the
newest snapshot and replays its journal through the same pure `Controller`
methods that made the decisions, so the rebuilt state is the state that was
lost. A torn last record (the process was killed mid-write) is cut off.

Durability: every record is written whole (`write(2)`, the rest of a short
write retried) before the reply that depends on it leaves the controller, so
a controller killed with SIGKILL loses nothing; `fsync` runs in batches, within
`fsync_interval` seconds of a write, so a crash of the whole machine can lose the
decisions of that last interval. When the journal grows past `compact_bytes`
a new snapshot replaces it.

A full disk (write-ahead): a request's record is written before the request
changes the controller (a commit, a partition operation, a confirm), or, for
a grant, the lease is given back when its record cannot be written; either
way the request fails with `DockStateFull` and nothing of it stays. A request
that its checks refuse after its record was written (a put past
`--max-samples`) has the record cut off again (`ahead`): a replay runs the
checks again, but not under the bounds the daemon was started with. Journal
space is reserved ahead with `fallocate` (1 MiB at a time, beyond the end of
the file), so a full disk is noticed before a decision and a record rarely
fails half-way; requests that add to the dock (puts, gets, reserves, tags,
loads) are refused while less than `_MARGIN` of it is left, which keeps room
for the records of decisions the controller makes on its own (expired leases,
warehouses lost and back) and for confirms, releases and extends. A write
that fails is cut back to the last whole record; if even that fails, or a
decision already made cannot be recorded, the journal stops taking records
until a fresh snapshot (retried every second or so) has captured the
controller. A restart on a full disk that cannot write its snapshot goes on
appending to the journal it read.

Lease deadlines are never recorded on the wall clock: a record holds the
seconds a lease had left when it was granted or extended (a snapshot, what it
had left then), and a restart gives every restored lease that many seconds
from the moment it starts. A clock jump between the two runs can therefore
neither expire a live consumer's lease nor strand a dead one's samples; a
dead holder's lease ends at most one lease span after the restart.

The records, how they are packed and how each replays onto a controller: `dockd.controller.records`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import re
import time
import zlib
from collections.abc import Callable, Mapping

import msgpack

from dockd import dirlock
from dockd.controller.core import Controller
from dockd.controller.records import HEAD, JournalError, RecordWriter, apply, read
from dockd.errors import DockStateFull

logger = logging.getLogger(__name__)

_SNAP = re.compile(r"snapshot-(\d+)\.msgpack$")
_CHUNK = 1 << 20  # journal space reserved ahead at a time, when the disk has it
_MARGIN = 64 << 10  # requests that add to the dock are refused with less than this reserved ahead
_RETRY_MIN, _RETRY_MAX = 1.0, 10.0  # seconds between attempts at a snapshot that failed
_LOG_EVERY = 10.0  # seconds between log lines about refused requests
_NO_PREALLOC = 1 << 62


def _fallocate():
    """fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) from libc, or None where there is none."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int

    def reserve(fd: int, offset: int, length: int) -> None:
        if fn(fd, 1, offset, length) != 0:  # 1: FALLOC_FL_KEEP_SIZE (the file's size stays its records')
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    return reserve


_reserve_space = _fallocate()


def _write_all(fd: int, data: bytes | bytearray) -> None:
    """Write all of data, retrying the rest of a short write; OSError if the disk takes no more."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def _nothing() -> None: ...


def ahead(journal: Journal | None) -> contextlib.AbstractContextManager:
    return journal.ahead() if journal is not None else contextlib.nullcontext()  # (nothing to cut off without one)


class _Ahead:
    """`Journal.ahead`: a class, not a generator, since every commit enters one."""
    __slots__ = ("journal", "size", "records")
    def __init__(self, journal: Journal) -> None:
        self.journal, self.size, self.records = journal, journal.size, journal.records
    def __enter__(self) -> None: ...
    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None and self.journal.size > self.size:
            self.journal._undo(self.size, self.records)


class Journal(RecordWriter):
    """Records the controller's decisions in a state dir and rebuilds them on restart."""

    def __init__(self, path: str | os.PathLike, *, fsync_interval: float = 0.05, compact_bytes: int = 64 << 20) -> None:
        self.dir = pathlib.Path(path)
        self.fsync_interval = fsync_interval
        self.compact_bytes = compact_bytes
        self.gen = 0
        self._fd = -1
        self.size = 0  # bytes of whole records in the current journal file
        self.reserved = 0  # the file's space is reserved up to this offset (>= size)
        self.dirty = False
        self.records = 0
        self._prealloc = _reserve_space is not None  # space can be reserved ahead (until fallocate says no)
        self._last_error: OSError | None = None
        # why the journal takes no records until a snapshot captured the controller (None: it does)
        self.broken: str | None = None
        self.refused = 0  # requests refused since the last log line about them
        self._full_since = 0.0  # when requests began to be refused (0: they are not)
        self._logged_at = -_LOG_EVERY
        self._retry_at = 0.0  # loop time before which a failed snapshot is not tried again
        self._retry_wait = _RETRY_MIN
        self._packer = msgpack.Packer(use_bin_type=True)  # (one for every record: packb makes one per call)
        self._held = bytearray()  # records held until the next write (append(hold=True))
        self._held_records = 0
        self._lock = -1  # the descriptor holding STATE_DIR/lock (see `lock`)
        # called when there is something to sync: the first record written since the last fsync, or the
        # journal stopped taking records (a snapshot is due); the service's syncer arms its timer then
        self.on_due: Callable[[], None] = _nothing

    # -- recovery ------------------------------------------------------------------------
    def lock(self) -> None:
        """Hold the state dir for this process (until `close` or its exit): JournalError naming the
        holder's pid when another controller holds it. The daemon calls it before `load`."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot create the state dir {self.dir}: {e}") from None
        if self._lock < 0:
            self._lock = dirlock.hold(str(self.dir), "--state-dir", JournalError)

    def load(self, *, lease_timeout: float, now: float) -> tuple[Controller, dict[int, dict]]:
        """Rebuild the controller (deadlines on the clock whose current reading is `now`) and
        its warehouse registry from the state dir; then start a fresh snapshot + journal (or,
        with no room for a snapshot, go on appending to the journal just read)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot create the state dir {self.dir}: {e}") from None
        gens = sorted(int(m.group(1)) for f in self.dir.iterdir() if (m := _SNAP.match(f.name)))
        core, warehouses = Controller(lease_timeout=lease_timeout), {}
        if gens:
            self.gen = gens[-1]
            snap_path = self.dir / f"snapshot-{self.gen}.msgpack"
            try:
                snap = msgpack.unpackb(snap_path.read_bytes(), raw=False, strict_map_key=False)
                # deadlines are stored as seconds left ("remaining"): restore them as now + that
                core = Controller.restore(snap["controller"], wall_offset=-now, lease_timeout=lease_timeout)
            except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                raise JournalError(f"cannot read the controller snapshot {snap_path}: {e}. Move the state dir "
                                   "away to start empty.") from None
            if snap.get("clock") != "remaining":  # an older dockd stored wall-clock deadlines: a fresh lease span
                for lease in list(core.leases.values()):
                    core.extend(lease.id, now + core.lease_timeout)
            warehouses = {int(w["id"]): w for w in snap["warehouses"]}
        log = self.dir / f"journal-{self.gen}.log"
        replayed = skipped = good = 0
        if log.exists():
            with core.catalog.cells.unbounded():  # (what was decided is rebuilt, whatever the bound now)
                for rec, good in read(log):  # noqa: B007 - good: where the last whole record ends
                    if not apply(core, warehouses, rec, now):
                        skipped += 1
                    replayed += 1
            try:  # cut a torn tail, and give back space an earlier run reserved past the last record
                os.truncate(log, good)
            except OSError as e:
                raise JournalError(f"cannot cut the torn end of {log}: {e}") from None
        if gens or replayed:
            logger.info("[journal] recovered state_dir=%s snapshot=%d records=%d refused_requests=%d partitions=%d "
                        "leases=%d", self.dir, self.gen, replayed, skipped, len(core.partitions), len(core.leases))
        if not self.compact(core, warehouses, now=now):
            try:
                self._fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise JournalError(f"cannot write the state dir {self.dir}: {e}") from None
            self.size, self.reserved = good, good if self._prealloc else _NO_PREALLOC
            logger.warning("[journal] no room for a snapshot in %s: appending to %s after its %d bytes of records",
                           self.dir, log.name, good)
        return core, warehouses

    # -- room --------------------------------------------------------------------------------
    def room(self, adds: bool = True) -> None:
        """Raise DockStateFull unless a request that adds to the dock may be decided now: the
        journal takes records and has `_MARGIN` bytes reserved ahead (reserving more if need be).
        `adds` False: a request that writes samples the dock holds already (a block commit, whose
        samples its grant added; its put was answered), which the margin is kept for: refused only
        while the journal takes no records."""
        if self.broken is None and (not adds or self.reserved - self.size >= _MARGIN or self._reserve(_MARGIN)):
            return
        raise self._refuse()

    def _reserve(self, need: int) -> bool:
        """Reserve space for `need` more bytes of records (a chunk, or as much as `need` and
        the margin, or just `need`). False when the disk has not even that."""
        if not self._prealloc:
            return self._no_prealloc(None)
        err = None
        for length in (max(_CHUNK, need + _MARGIN), need + _MARGIN, need):
            end = self.size + length
            if end <= self.reserved:
                return True
            try:
                _reserve_space(self._fd, self.reserved, end - self.reserved)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    return self._no_prealloc(e)
                err = e
                continue
            self.reserved = end
            self._resumed()
            return True
        self._last_error = err
        return False

    def _no_prealloc(self, e: OSError | None) -> bool:
        if self._prealloc:
            logger.info("[journal] %s cannot reserve space ahead (%s): a full disk is noticed when a record fails",
                        self.dir, e)
            self._prealloc = False
        self.reserved = _NO_PREALLOC
        return True

    def _resumed(self) -> None:
        if self._full_since:
            logger.warning("[journal] the state dir %s has room again after %.0fs; requests refused meanwhile: %d",
                           self.dir, time.monotonic() - self._full_since, self.refused)
            self._full_since, self.refused = 0.0, 0

    def _free(self) -> int:
        try:
            st = os.statvfs(self.dir)
            return st.f_bavail * st.f_frsize
        except OSError:
            return -1

    def _refuse(self, cause: OSError | None = None) -> DockStateFull:
        """The error a refused request gets; logged at most every _LOG_EVERY seconds."""
        cause = cause or getattr(self, "_last_error", None)
        free = self._free()
        if self.broken is not None:
            why = (f"the controller cannot record its decisions in its state dir {self.dir} ({self.broken}); it "
                   f"takes no requests until a fresh snapshot is written there ({free} bytes free)")
        elif cause is None or cause.errno in (errno.ENOSPC, errno.EDQUOT):
            why = f"the controller's state dir {self.dir} is full ({free} bytes free)"
        else:
            why = f"the controller cannot write its state dir {self.dir} ({cause})"
        now = time.monotonic()
        if not self._full_since:
            self._full_since = now
        self.refused += 1
        if now - self._logged_at >= _LOG_EVERY:
            self._logged_at = now
            logger.error("[journal] %s: refusing requests (refused=%d since %.0fs ago)", why, self.refused,
                         now - self._full_since)
        return DockStateFull(f"{why}: this request was not applied; free space there and retry, the dock "
                             "resumes by itself")

    # -- writing ---------------------------------------------------------------------------
    def append(self, rec: list, *, applied: bool = False, hold: bool = False) -> bool:
        """Write one whole record. A request's record (`applied` False) raises DockStateFull when
        it cannot be written, leaving the journal as it was. A record of a decision already
        applied returns False instead and stops the journal until a snapshot (see `broken`).

        `hold`: room for the record is reserved now (so a full disk refuses it now), but it goes to
        the file with the next record written, or at `flush`: a request's records in one write. Its
        caller applies it at once, so a held record that cannot be written stops the journal as an
        applied one does."""
        body = self._packer.pack(rec)
        data = HEAD.pack(len(body), zlib.crc32(body)) + body
        err = None
        if self.broken is None:
            held = len(self._held)
            if self.size + held + len(data) > self.reserved and not self._reserve(held + len(data)):
                err = self._last_error
            elif hold:
                self._held += data
                self._held_records += 1
                return True
            else:
                if held:
                    self._held += data
                    data = self._held
                err = self._write(data, 1)
                if err is None:
                    return True
        if not applied:
            raise self._refuse(err)
        if self.broken is None:
            self._break(f"a {rec[0]} record could not be written: {err}")
        return False

    def flush(self) -> None:
        """Write the records held (see `append`); if that fails the journal stops until a snapshot."""
        if self._held and self.broken is not None:  # (the snapshot that resumes the journal captures them)
            self._held, self._held_records = bytearray(), 0
        elif self._held:
            n = self._held_records
            err = self._write(self._held, 0)
            if err is not None and self.broken is None:
                self._break(f"{n} record(s) could not be written: {err}")

    def _write(self, data: bytes | bytearray, records: int) -> OSError | None:
        """Write `data` (the held records first, and `records` more) at the end of the file; held records that
        fail with it stop the journal (a partly written record is cut off)."""
        held, self._held_records = self._held_records, 0
        try:
            _write_all(self._fd, data)
        except OSError as e:
            self._cut(e)
            if held:
                self._break(f"{held} record(s) already applied could not be written: {e}")
            return e
        else:
            self.size += len(data)
            self.records += held + records
            if not self.dirty:
                self.dirty = True
                self.on_due()
            return None
        finally:
            self._held = bytearray()

    def ahead(self) -> _Ahead:
        """Around a request's records and the change they are written ahead of: if the change is refused
        (it raises), its records are cut off again, so that a restart never applies what its client was
        told failed (a replay checks the request again, but not always under the same bounds)."""
        return _Ahead(self)

    def _undo(self, size: int, records: int) -> None:
        if self._truncate(size, "the record of a refused request"):
            self.size, self.records, self.dirty = size, records, True

    def _cut(self, e: OSError) -> None:
        """Undo a record that was written in part: the file ends at the last whole record."""
        self._truncate(self.size, f"a record failed ({e}) and")

    def _truncate(self, size: int, what: str) -> bool:
        """End the file at `size` (space reserved past it is given back); False, and no more records until a
        snapshot, when that fails."""
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            self._break(f"{what} could not be cut off ({e})")
            return False
        finally:
            if self._prealloc:
                self.reserved = min(self.reserved, size)
        return True

    def _break(self, why: str) -> None:
        logger.error("[journal] %s: the state dir %s takes no records until a snapshot captured the controller",
                     why, self.dir)
        self.broken = why
        self._retry_at = 0.0
        self.on_due()

    def sync(self) -> None:
        """fsync what was written (called from a worker thread within fsync_interval of a write: `on_due`)."""
        if self.dirty and self._fd >= 0:
            self.dirty = False
            os.fsync(self._fd)

    def needs_compaction(self) -> bool:
        return self.size > self.compact_bytes

    def compaction_due(self, now: float) -> bool:
        """A snapshot is due: the journal is large, or it stopped taking records (not before a
        failed attempt's back-off, `now` on the loop's clock)."""
        return (self.broken is not None or self.size > self.compact_bytes) and now >= self._retry_at

    def compact(self, core: Controller, warehouses: Mapping[int, dict], *, now: float) -> bool:
        """Write a new snapshot and start an empty journal after it; drop the older files.
        False when that cannot be done (the disk is full): the current journal goes on."""
        gen = self.gen + 1
        # lease deadlines as seconds left (`deadline - now`), not on the wall clock
        snap = {"controller": core.snapshot(-now), "clock": "remaining", "warehouses": list(warehouses.values())}
        tmp = self.dir / f"snapshot-{gen}.tmp"
        snap_path = self.dir / f"snapshot-{gen}.msgpack"
        log = self.dir / f"journal-{gen}.log"
        fd = -1
        renamed = False
        if self.broken is not None and self._fd >= 0 and self._prealloc:
            try:  # the old journal's reserved space is the snapshot's best chance
                os.ftruncate(self._fd, self.size)
                self.reserved = self.size
            except OSError:
                pass
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
            sfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(sfd, msgpack.packb(snap, use_bin_type=True))
                os.fsync(sfd)
            finally:
                os.close(sfd)
            os.replace(tmp, snap_path)
            renamed = True
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the rename and the new journal are durable before the old files go
            finally:
                os.close(dfd)
        except OSError as e:
            for path in (tmp, snap_path if renamed else None, log):
                if path is not None:
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)
            self._retry_at = now + self._retry_wait
            self._retry_wait = min(self._retry_wait * 2, _RETRY_MAX)
            logger.log(logging.ERROR if self.broken is not None else logging.WARNING,
                       "[journal] cannot write a snapshot in %s (%s); next try in %.0fs", self.dir, e,
                       self._retry_at - now)
            return False
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.gen, self.size, self.dirty = fd, gen, 0, False
        self.reserved = 0 if self._prealloc else _NO_PREALLOC
        self._retry_wait = _RETRY_MIN
        if self.broken is not None:
            logger.warning("[journal] a snapshot in %s captured the controller: the journal takes records again",
                           self.dir)
            self.broken = None
            self._resumed()
        for f in self.dir.iterdir():
            m = re.match(r"(?:snapshot|journal)-(\d+)\.(?:msgpack|log|tmp)$", f.name)
            if m and int(m.group(1)) < gen:
                f.unlink(missing_ok=True)
        return True

    def close(self) -> None:
        if self._fd >= 0:
            try:
                if self.reserved != _NO_PREALLOC and self.reserved > self.size:
                    os.ftruncate(self._fd, self.size)  # give back the space reserved ahead
                os.fsync(self._fd)
            except OSError as e:
                logger.warning("[journal] closing %s: %s", self.dir, e)
            finally:
                os.close(self._fd)
                self._fd = -1
        dirlock.release(self._lock)
        self._lock = -1
