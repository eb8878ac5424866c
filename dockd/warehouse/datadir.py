"""A warehouse's data dir (`dockd serve --join ADDR --data-dir DIR`): stored puts outlive the process.

Every put the warehouse stores is also written to a file of its own in DIR,
and fsync'd, before the writer is answered; frees, deletes and clears remove
the files (or record the deleted samples) as they happen. A warehouse killed
(SIGKILL included) and started again on the same DIR reads the files back into
fresh sealed shared-memory segments, rebuilds its stored values, and rejoins
its controller under the same warehouse id and instance with that inventory.
Readers are still only ever handed sealed memfds: the files are read once, at
start, and never mapped to a reader.

Layout:

    DIR/lock                   held (flock) by the warehouse using the dir, its pid written in it: a
                               second one refuses to start (`dockd.dirlock`)
    DIR/identity.json          the dock this dir belongs to, the warehouse id and instance,
                               the put-id floor (commits of a new process never reuse an id),
                               the dock's controllers (a restart asks them all for the list)
    DIR/p-<sha1(partition)>/   one directory per partition (a real one: a symbolic link is refused)
        <n>.put                one stored put (`dockd.warehouse.putfile`): fixed header, JSON header,
                               checksums, its columns' runs (a serialized PutRequest), its body
        .<n>.tmp               a put being written: renamed to <n>.put once whole and fsync'd
        deleted                indexes of samples deleted while the rest of their put lives (each
                               with a check: `dir_records`); rewritten with those of the files still there
        committed              numbers of its files of puts answered before their commit
                               (--commit-window) whose commit the controller answered; at start the
                               others are committed again (`readback.adopt`), and it is compacted
    DIR/.free-<n>              the file of a freed put, kept to write a later put over, or the
                               room taken for a put before its commit (allocated whole, so a full
                               disk fails the put before the controller records it; a big put's
                               body is written into it and flushed before the commit, its header
                               after); renamed to its <n>.put once whole and fsync'd
    DIR/damaged/               files that failed their check, moved aside by --drop-damaged-files

A `.tmp` file left by a kill is a put that was never acknowledged: it is
removed at start with a log line, as is a `.free-` file. A `.put` file is
complete (written under its temporary name, fsync'd, then renamed), and every
byte of it is checksummed (format 3; files of formats 1 and 2 are still read).
Only regular files are opened, never blocking. A file that fails its check
refuses the start (`DockDataDirError` naming it), as does a dir of another
dock (another token, or another controller without a token) or of another
user. With `--drop-damaged-files` such a file is moved to `damaged/` instead
and what it held is reported lost: `report` hands the first rejoin the
samples it held (the controller marks those it recorded lost, DockDataLost
for readers, unless a replica holds them; those of a put answered before a
commit it never applied are holes), or, when the file is too damaged to say, tells
it that every value it records on this warehouse and does not get back is
lost. Each dropped file gets an error line saying which.

The instance a warehouse with a data dir draws has bit 62 set
(`dockd.terms.DURABLE`): its controller then waits out `--warehouse-grace` for
a restart instead of declaring it lost when its address refuses connections,
and a value it recorded on it that the restarted warehouse does not hold (its
commit was applied but the kill came before the file was written, so the put
was never acknowledged) becomes unwritten again rather than lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dockd import dirlock
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockStateFull, DockValueError
from dockd.net import auth
from dockd.terms import DURABLE
from dockd.warehouse import dir_records, putfile
from dockd.warehouse.putfile import HEAD as _HEAD
from dockd.warehouse.putfile import Damaged, Room, part_dir

if TYPE_CHECKING:
    from dockd.config import NodeConfig

logger = logging.getLogger(__name__)

IDENTITY = "identity.json"
DELETED = "deleted"
COMMITTED = "committed"
DAMAGED = "damaged"  # where --drop-damaged-files moves files that fail their check
SEQ_GAP = 1 << 32  # put ids a process may use; the next process starts above them
FREE_FILES, FREE_BYTES = 64, 1 << 30  # files of freed puts kept to write the next puts over (see DataDir.stored)
COMPACT_AT = 4096  # records a `committed` or `deleted` file holds before it is rewritten (at twice what it kept)


class DockDataDirError(DockValueError):
    """A data dir that this warehouse must not adopt (another dock's, another user's, damaged)."""


def dock_of(cfg: NodeConfig) -> dict:
    """What ties a data dir to its dock: the token's fingerprint (never the token), and the controller."""
    token = auth.load_token(cfg.token_file) if cfg.token_file else b""
    fp = hashlib.sha256(b"dockd data dir\0" + token).hexdigest()[:32] if token else ""
    return {"token": fp, "controller": cfg.join_addresses[0] if cfg.join else ""}


def _write_all(fd: int, bufs: Sequence) -> None:
    views = [memoryview(b).cast("B") for b in bufs if len(memoryview(b))]
    while views:
        n = os.writev(fd, views[:512])
        while n:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


class DataDir:
    """The files of one warehouse's data dir; `Warehouse.keeper` while it stores."""

    def __init__(self, path: str, dock: dict, *, drop_damaged: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.dock = dock
        self.drop_damaged = drop_damaged  # --drop-damaged-files: move a file that fails its check aside, not refuse
        self.instance = 0
        self.wid = -1
        self.port = 0  # the port the last process listened on (a restart with --port 0 takes it again)
        self.seq = 0
        self.controllers: list[str] = []  # the dock's controllers when it last joined
        self.next_file = 1
        self._lock = -1  # the descriptor holding DIR/lock while this process uses the dir
        self.adopting: str | None = None  # the file being read back: store() must not write it again
        # files of freed puts: writing a put over one reuses its pages (on tmpfs a fresh page is allocated
        # and zeroed at about half the speed of a copy into one that exists)
        self._free: list[tuple[int, str]] = []
        self._free_bytes = 0
        self._free_seq = 0
        self.lost: list[putfile.Held] = []  # what the files dropped at start held (--drop-damaged-files)
        self.lost_unknown: list[str] = []  # dropped files too damaged to say what they held (where they are now)
        # files read back of puts answered before their commit, not known committed: (path, the commit again)
        self.uncommitted: list[tuple[str, pb.CommitRequest]] = []
        # partition dir -> (the numbers its `committed` file lists of files still there, records it holds)
        self._listed: dict[str, tuple[set[int], int]] = {}
        self._dirs: dict[str, dir_records.Deletes] = {}  # partition dir -> its put files and its `deleted` record
        self._unrecorded = 0  # answered commits that could not be recorded there (a full disk)
        self._unrecorded_deletes = 0  # ... and deletes

    # -- identity --------------------------------------------------------------------------------
    def open(self) -> int:
        """Lock the dir for this process, check it is ours and this dock's (making it if need be);
        this process's instance."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            st = os.stat(self.path)
        except OSError as e:
            raise DockDataDirError(f"cannot use --data-dir {self.path}: {e.strerror or e}") from None
        self.check_owner(self.path, st)
        if self._lock < 0:  # (before anything in it is read or written)
            self._lock = dirlock.hold(self.path, "--data-dir", DockDataDirError)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("[datadir] %s is open to other users (mode %o); chmod 700 it", self.path, st.st_mode & 0o777)
        ident = os.path.join(self.path, IDENTITY)
        try:
            fd = putfile.open_regular(ident)
            try:
                self.check_owner(ident, os.fstat(fd))
                rec = json.loads(putfile.read_all(fd))
            finally:
                os.close(fd)
        except FileNotFoundError:
            rec = None
        except (OSError, ValueError, Damaged) as e:
            raise DockDataDirError(f"--data-dir {self.path}: cannot read {IDENTITY} ({e}); move the dir away to "
                                   "start this warehouse empty") from None
        if rec is None:
            if any(n.startswith("p-") for n in os.listdir(self.path)):
                raise DockDataDirError(f"--data-dir {self.path} holds stored puts but no {IDENTITY}; move the dir "
                                       "away (or give an empty one) to start this warehouse empty")
            self.instance = secrets.randbits(62) | DURABLE | 1
            self.seq = 0
        else:
            self.check_dock(rec.get("dock", {}), f"{ident}")
            self.instance = int(rec["instance"]) | DURABLE
            self.wid = int(rec.get("warehouse", -1))
            self.port = int(rec.get("port", 0))
            self.seq = int(rec.get("seq", 0)) + SEQ_GAP
            self.controllers = [str(a) for a in rec.get("controllers", ())]
        try:
            self._save_identity()
        except OSError as e:  # (the put-id floor must be on disk before a put uses an id above it)
            free = shutil.disk_usage(self.path).free
            raise DockDataDirError(f"--data-dir {self.path}: cannot write {IDENTITY} ({e.strerror or e}; {free} bytes "
                                   "free there); its stored puts are intact: free room on that disk and start this "
                                   "warehouse again") from None
        return self.instance

    def close(self) -> None:
        """Give the dir back (the process's exit does so too)."""
        dirlock.release(self._lock)
        self._lock = -1

    def check_owner(self, path: str, st: os.stat_result) -> None:
        if st.st_uid != os.getuid():
            raise DockDataDirError(
                f"--data-dir: {path} belongs to uid {st.st_uid}, not to this warehouse's user (uid {os.getuid()}); "
                "a warehouse adopts only its own user's data. Run it as that user, or give it a dir of its own")

    def check_dock(self, theirs: dict, where: str) -> None:
        mine = self.dock
        if theirs.get("token", "") != mine["token"]:
            what = ("was written by a dock with another token" if theirs.get("token") and mine["token"] else
                    "was written by a dock with a token, and this warehouse has none" if theirs.get("token") else
                    "was written by a dock without a token, and this warehouse has one")
            raise DockDataDirError(
                f"--data-dir {self.path} belongs to another dock: {where} {what} (controller "
                f"{theirs.get('controller') or '?'}). Its samples are not this dock's; give this warehouse another "
                "--data-dir, or remove that one if its data is no longer wanted")
        if not mine["token"] and theirs.get("controller") != mine["controller"]:
            raise DockDataDirError(
                f"--data-dir {self.path} belongs to another dock: {where} was written by a warehouse of the "
                f"controller at {theirs.get('controller')!s}, and this one joins {mine['controller']} (without a "
                "token the controller's address names the dock). Give it --join "
                f"{theirs.get('controller')}, another --data-dir, or remove that one if its data is no longer wanted")

    def _save_identity(self) -> None:
        rec = {"format": putfile.FORMAT, "dock": self.dock, "warehouse": self.wid, "port": self.port, "instance": self.instance,
               "seq": self.seq, "controllers": self.controllers}
        tmp = os.path.join(self.path, f".{IDENTITY}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(rec, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, os.path.join(self.path, IDENTITY))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def joined(self, wid: int, port: int, controllers: list[str]) -> None:
        """Joined as warehouse `wid`, listening on `port`, to the dock's `controllers`: what a restart
        comes back as (asking those controllers too, should the one it --joins be down)."""
        if (wid, port, controllers) != (self.wid, self.port, self.controllers):
            self.wid, self.port, self.controllers = wid, port, list(controllers)
            try:
                self._save_identity()
            except OSError as e:
                logger.error("[datadir] could not write %s in %s (%s): a restart before it is written comes back "
                             "as the warehouse it was before this join; free room on that disk", IDENTITY, self.path,
                             e.strerror or e)

    # -- puts --------------------------------------------------------------------------------------
    def room(self, partition: str, columns: Sequence[pb.ColumnData], nbytes: int, samples: int) -> Room | None:
        """Disk room for a put's file, taken before the put is committed (a file of its own, allocated
        whole: `posix_fallocate`), so that a full disk fails the put before the controller records
        its values, not after; for `prewrite` and `stored` (or `give_back` when the put is not
        stored). None while adopting. A `.free-` file, so that a kill leaves nothing adopted."""
        if self.adopting is not None:
            return None
        # what the file can take: headers (the JSON one with the partition and the dock), the runs and
        # the indexes (at most 11 bytes each as a varint with its tag), the body
        size = (_HEAD.size + putfile.SUMS.size + 1024 + 2 * len(partition.encode()) + len(json.dumps(self.dock))
                + sum(c.ByteSize() for c in columns) + 11 * samples + nbytes)
        path = self._take_free(size)
        if path is None:
            self._free_seq += 1
            path = os.path.join(self.path, f".free-{self._free_seq:x}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise self._full(e, f"has no room for its {size} bytes") from None
        return Room(path, size, nbytes)

    def prewrite(self, room: Room, body) -> None:
        """Write a put's body into its room, at the end where `stored` expects it, and flush it to disk
        before the put is committed. Big puts do this in a worker thread, so the event loop writes only
        the header once the commit has given the put its indexes."""
        data = memoryview(body).cast("B")[: room.nbytes]
        try:
            fd = os.open(room.path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                at, left = room.size - room.nbytes, data
                while len(left):
                    n = os.pwrite(fd, left, at)
                    left, at = left[n:], at + n
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._full(e, "could not be written") from None
        room.crc_body = zlib.crc32(data)

    def give_back(self, room: Room | None) -> None:
        """Room taken for a put that was not stored (it failed, or its values are held already)."""
        if room is not None:
            self._keep_or_delete(room.path, rename=False)

    def _full(self, e: OSError, what: str) -> DockStateFull:
        free = shutil.disk_usage(self.path).free if os.path.isdir(self.path) else 0
        return DockStateFull(f"this put was not stored: its file in --data-dir {self.path} {what} "
                             f"({e.strerror or e}; {free} bytes free there). Free room there and retry")

    def stored(self, partition: str, idx: np.ndarray, columns: Sequence[pb.ColumnData], body: pa.Buffer | None,
               nbytes: int, group_size: int, token: int, room: Room | None = None) -> str:
        """Write one put (its indexes known) and fsync it, into its `room` if one was taken (only its
        header, if `prewrite` wrote the body there); its file's path."""
        if self.adopting is not None:
            if self.adopting:
                self._deletes(os.path.dirname(self.adopting)).hold(self.adopting, idx)
            return self.adopting
        d = os.path.join(self.path, part_dir(partition))
        n, self.next_file = self.next_file, self.next_file + 1
        final = os.path.join(d, f"{n:016x}.put")
        meta = {"dock": self.dock, "partition": partition, "group_size": group_size, "token": token}
        early = room.commit if room is not None else None  # (answered before its commit: see `committed`)
        if early is not None:
            meta["block"], meta["put_id"] = early.block, early.put_id
        runs = pb.PutRequest(partition=partition, indexes=idx.tolist(), columns=columns,
                             tags=early.tags if early is not None else ()).SerializeToString()
        enc = None
        if room is not None and room.crc_body is not None:  # the body is in place at the room's end: the headers
            enc = putfile.encode(meta, runs, nbytes, room.crc_body, body_at=room.size - room.nbytes)  # go in front
        if enc is None:  # written whole
            data = memoryview(body).cast("B")[:nbytes] if body is not None and nbytes else memoryview(b"")
            enc = putfile.encode(meta, runs, len(data), zlib.crc32(data))
            assert enc is not None  # (only a body in place can leave the headers no room)
            enc[0].append(data)
        parts, size = enc
        over = room.path if room is not None else self._take_free(nbytes)
        tmp = over if over is not None else os.path.join(d, f".{n:016x}.tmp")
        try:
            if over is not None:  # (a kill while it is written leaves a .free file: never adopted)
                fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            else:
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                except FileNotFoundError:
                    os.makedirs(d, mode=0o700, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, parts)
                if over is not None:
                    os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            if over is not None and not os.path.isdir(d):
                os.makedirs(d, mode=0o700, exist_ok=True)
            os.rename(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._full(e, "could not be written") from None
        if room is not None:
            room.file = final
        self._deletes(d).hold(final, idx)
        return final

    def _deletes(self, pdir: str) -> dir_records.Deletes:
        return self._dirs.setdefault(pdir, dir_records.Deletes())

    def remove(self, path: str) -> None:
        """A put whose samples are all gone: its file is kept to write a later put over, or deleted."""
        d, name = os.path.split(path)
        if (listed := self._listed.get(d)) is not None:
            listed[0].discard(file_number(name))
        if (dels := self._dirs.get(d)) is not None:
            dels.drop(path)
        self._keep_or_delete(path, rename=True)

    def _keep_or_delete(self, path: str, *, rename: bool) -> None:
        """Keep a file among the free ones (`rename`: to a `.free-` name first) while they stay under
        FREE_FILES and FREE_BYTES, else delete it; one already gone is nothing to do."""
        try:
            size = os.stat(path).st_size
            if len(self._free) < FREE_FILES and self._free_bytes + size <= FREE_BYTES:
                if rename:
                    self._free_seq += 1
                    free = os.path.join(self.path, f".free-{self._free_seq:x}")
                    os.rename(path, free)
                    path = free
                self._free.append((size, path))
                self._free_bytes += size
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass

    def _take_free(self, nbytes: int) -> str | None:
        """The kept file nearest in size to a put of `nbytes` (the smallest that holds it, else the largest)."""
        if not self._free or nbytes < 64 << 10:  # (small puts: a fresh file costs no more)
            return None
        fits = [f for f in self._free if f[0] >= nbytes]
        pick = min(fits) if fits else max(self._free)
        self._free.remove(pick)
        self._free_bytes -= pick[0]
        return pick[1]

    def deleted(self, partition: str, idx: np.ndarray) -> None:
        """Samples deleted while the rest of their put lives (their file still holds them). The record is
        rewritten with the samples of the files still there once it is big and mostly stale (`dir_records`):
        a long stream of samples deleted, their files removed, keeps it at the size of what the dir holds."""
        if self.adopting is not None or not len(idx):
            return
        d = os.path.join(self.path, part_dir(partition))
        dels = self._deletes(d)
        if dels.unrecorded:  # (deletes a full disk kept out of it before go too, those of files still there)
            idx = np.concatenate([dels.live(np.concatenate(dels.unrecorded)), np.asarray(idx, dtype=np.int64)])
        try:
            dir_records.append(os.path.join(d, DELETED), idx)
        except FileNotFoundError:  # (nothing of the partition is stored)
            dels.unrecorded.clear()
            return
        except OSError as e:  # a full disk: the samples are freed all the same, the free never fails on it
            dels.unrecorded[:] = [dels.live(idx)]
            self._unrecorded_deletes += 1
            dir_records.not_recorded(os.path.join(d, DELETED), e, self._unrecorded_deletes, f"the delete of {len(idx)} "
                                     "samples", "they are freed here all the same, and recorded with the next delete "
                                     "once there is room; should this warehouse restart before that, it reads them "
                                     "back and its controller frees them again (it records every delete, and never "
                                     "hands a deleted sample out again)")
            return
        dels.unrecorded.clear()
        if dels.appended(len(idx), COMPACT_AT):
            try:
                self.compact_deleted(d, dir_records.read(os.path.join(d, DELETED)))
            except (OSError, Damaged) as e:  # (a full disk: the record kept is the old one, whole)
                logger.warning("[datadir] could not rewrite %s in %s (%s): it keeps every delete, stale ones too, "
                               "until the next try", DELETED, d, getattr(e, "strerror", None) or e)

    def compact_deleted(self, pdir: str, recorded: np.ndarray) -> None:
        """Rewrite partition dir `pdir`'s `deleted` record with the samples of `recorded` that its put files
        still there hold (at start, once the recorded deletes are applied; and while it runs)."""
        dels = self._deletes(pdir)
        kept = dels.live(recorded)
        dir_records.replace(os.path.join(pdir, DELETED), kept)
        dels.records = dels.kept = len(kept)

    def committed(self, path: str) -> None:
        """The early commit of put file `path` was answered: a restart does not send it again (a record lost
        to a power cut, not fsync'd, only sends it again: `controller.blocks.judge` answers it AGAIN). The
        record is rewritten with the files still there once it holds COMPACT_AT records and twice as many
        as those: a long stream of puts, each consumed and its file removed, keeps it small."""
        d, name = os.path.split(path)
        n = file_number(name)
        if n is None or not os.path.isdir(d):  # (its dir gone: its samples are)
            return
        listed, records = self._listed.get(d) or (set(), 0)
        listed.add(n)
        try:
            if records + 1 > max(COMPACT_AT, 2 * len(listed)):
                self.compact_committed(d, listed)
            else:
                dir_records.append(os.path.join(d, COMMITTED), np.array([n], dtype=np.int64))
                self._listed[d] = (listed, records + 1)
        except OSError as e:  # (a full disk: the record is what a restart sends again, never lost values)
            self._unrecorded += 1
            dir_records.not_recorded(os.path.join(d, COMMITTED), e, self._unrecorded, f"the answered commit of {path}",
                                     "a restart sends it again, answered as applied")

    def compact_committed(self, pdir: str, kept: set[int]) -> None:
        """Rewrite partition dir `pdir`'s `committed` file with the numbers `kept` (of files still there, so
        a number given again to a later file is never listed); a kill during the rewrite leaves the old
        list, which only lists more (files gone, no longer read back): `dir_records.replace`)."""
        self._listed[pdir] = (kept, len(kept))
        dir_records.replace(os.path.join(pdir, COMMITTED), np.asarray(sorted(kept), dtype="<i8"))

    def cleared(self, partition: str) -> None:
        d = os.path.join(self.path, part_dir(partition))
        self._listed.pop(d, None)
        self._dirs.pop(d, None)
        if os.path.isdir(d):
            for e in os.scandir(d):
                if e.name.endswith(".put"):
                    self.remove(e.path)
            shutil.rmtree(d, ignore_errors=True)


def file_number(name: str) -> int | None:
    """The number of put file `name` (None: not a name dockd gives)."""
    try:
        return int(name[:-4], 16) if name.endswith(".put") else None
    except ValueError:
        return None
