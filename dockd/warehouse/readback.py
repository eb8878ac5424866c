"""Reading a data dir back when a warehouse starts on it (`DataDir.adopt`), and what to do with a file
that fails its check: refuse the start naming it, or with `--drop-damaged-files` move it into
DIR/damaged and report what it held lost (`report`: the first rejoin tells the controller, which
marks those values lost, DockDataLost for readers, unless a replica holds them).

A file of a put answered before its commit (--commit-window: its header names its block) that its
partition's `committed` record does not list may never have reached the controller: its commit is
made again from the file (`commit.commit_request`) and left in `DataDir.uncommitted`, for the node
to hand its controller link before the first registration (`RegisterWarehouse.pending`)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.net import memfd
from dockd.warehouse import dir_records, putfile
from dockd.warehouse.commit import commit_request
from dockd.warehouse.datadir import COMMITTED, DAMAGED, DELETED, DockDataDirError, file_number
from dockd.warehouse.layout import _runs
from dockd.warehouse.putfile import Damaged

if TYPE_CHECKING:
    from dockd.warehouse.admission import Admission
    from dockd.warehouse.core import Warehouse
    from dockd.warehouse.datadir import DataDir

logger = logging.getLogger(__name__)


def _readinto(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.readv(fd, [view])
        if n <= 0:
            raise EOFError("file ends early")
        view = view[n:]


def adopt(dd: DataDir, warehouse: Warehouse, admission: Admission, tokens) -> tuple[int, int]:
    """Read every stored put back (into sealed segments when big), store it again, apply the recorded
    deletes, and remember the puts' tokens (a writer re-sending one is answered, not stored twice).
    Returns (puts, bytes); the puts whose commit is to be made again go to `dd.uncommitted`."""
    puts, total, torn = 0, 0, 0
    entries = []
    # partition dir -> (the numbers its `committed` file lists, those of them still there): every such file is
    # compacted, also one whose dir has no early put left (a number it lists may be given to the next file)
    committed: dict[str, tuple[set[int], set[int]]] = {}
    pdirs = []
    for part in sorted(os.scandir(dd.path), key=lambda e: e.name):
        if part.name.startswith(".free-"):  # (a freed put's file, or one being written over when killed)
            os.unlink(part.path)
            continue
        if not part.name.startswith("p-"):
            continue
        if not part.is_dir(follow_symlinks=False):
            raise _not_a_dir(dd, part.path)
        pdirs.append(part.path)
        if os.path.exists(os.path.join(part.path, COMMITTED)):
            committed[part.path] = (_numbers(dd, os.path.join(part.path, COMMITTED)), set())
        for e in os.scandir(part.path):
            if e.name.endswith(".tmp"):
                logger.warning("[datadir] removing %s: a put being written when the last process ended "
                               "(never acknowledged)", e.path)
                os.unlink(e.path)
                torn += 1
            elif (n := file_number(e.name)) is not None or e.name.endswith(".put"):
                # (-1: not a name dockd gives: read, checked and numbered like the others)
                entries.append((-1 if n is None else n, e.path, part.name))
    entries.sort()
    dd.next_file = (entries[-1][0] + 1) if entries else 1
    parts: dict[str, str] = {}
    try:
        for n, path, pdir in entries:
            try:
                h, idx = _adopt_one(dd, path, pdir, warehouse, admission)
            except Damaged as d:
                _drop(dd, path, d, n in committed.get(os.path.dirname(path), (set(),))[0])
                continue
            parts[os.path.dirname(path)] = h.meta["partition"]
            token = int(h.meta.get("token", 0))
            if token:
                tokens.done(token, idx.tolist())
            if h.meta.get("block"):
                _early(dd, h, n, path, *committed.setdefault(os.path.dirname(path), (set(), set())))
            puts += 1
            total += h.blen
    finally:
        dd.adopting = None
    for pdir, (listed, kept) in committed.items():
        try:
            dd.compact_committed(pdir, kept)
        except OSError as e:  # (a full disk: the old record stays; no number it lists is given to a new file)
            dd.next_file = max([dd.next_file, *(n + 1 for n in listed)])
            _not_rewritten(pdir, COMMITTED, e)
    for pdir in pdirs:
        _apply_deletes(dd, admission, pdir, parts.get(pdir))
    logger.info("[datadir] adopted dir=%s puts=%d bytes=%d torn_removed=%d partitions=%d damaged_dropped=%d "
                "uncommitted=%d", dd.path, puts, total, torn, len(parts), len(dd.lost) + len(dd.lost_unknown),
                len(dd.uncommitted))
    return puts, total


def _early(dd: DataDir, h: putfile.Header, n: int, path: str, listed: set[int], kept: set[int]) -> None:
    """File `n` of a put answered before its commit: its commit is made again unless its partition's
    `committed` file lists it (then it goes into `kept`, what the compaction keeps)."""
    if n in listed:
        kept.add(n)
        return
    req = h.req
    req.token, req.group_size = int(h.meta.get("token", 0)), int(h.meta["group_size"])
    commit = commit_request(req, h.blen, dd.wid)
    commit.block, commit.put_id = int(h.meta["block"]), int(h.meta.get("put_id", 0))
    dd.uncommitted.append((path, commit))


def _numbers(dd: DataDir, path: str) -> set[int]:
    """The file numbers a `committed` file lists (a torn last record left out)."""
    return set(_record(dd, path, "the commits of puts answered before them are all sent again (one applied "
                                 "already is answered as applied)").tolist())


def _adopt_one(dd: DataDir, path: str, pdir: str, warehouse: Warehouse,
               admission: Admission) -> tuple[putfile.Header, np.ndarray]:
    """Read one put file back and store it; Damaged when it fails a check (nothing of it is kept)."""
    fd = putfile.open_regular(path)
    dest = None
    try:
        dd.check_owner(path, os.fstat(fd))
        try:
            h = putfile.read_header(fd, pdir)
        except OSError as e:
            raise Damaged(f"it cannot be read ({e.strerror or e})") from None
        dd.check_dock(h.meta.get("dock", {}), path)
        blen = h.blen
        if blen:
            if not warehouse.reserve(blen):
                raise DockDataDirError(
                    f"--data-dir {dd.path} holds more than this warehouse's --capacity ({warehouse.capacity} "
                    "bytes) allows; restart it with at least the capacity it had")
            dest = admission.allocate(blen)
            buf = dest.buffer if isinstance(dest, memfd.Segment) else dest
            try:
                os.lseek(fd, h.body_at, os.SEEK_SET)
                _readinto(fd, memoryview(dest.writable() if isinstance(dest, memfd.Segment) else buf).cast("B"))
            except (OSError, EOFError) as e:
                raise Damaged(f"its body cannot be read ({e})", h.held(), h.meta) from None
            if isinstance(dest, memfd.Segment):
                dest.seal()
            data = memoryview(buf).cast("B")[:blen]
        else:
            buf, data = None, memoryview(b"")
        h.check_body(data)
    except BaseException:
        if dest is not None:  # (nothing of a file that fails is kept)
            admission.release(unreserve=blen, seg=dest if isinstance(dest, memfd.Segment) else None)
        raise
    finally:
        os.close(fd)
    idx = np.asarray(h.req.indexes, dtype=np.int64)
    dd.adopting = path
    warehouse.store(h.meta["partition"], idx, h.req.columns, buf, blen,
                    dest if isinstance(dest, memfd.Segment) else None, h.meta["group_size"])
    return h, idx


def _apply_deletes(dd: DataDir, admission: Admission, pdir: str, partition: str | None) -> None:
    """Free the samples partition dir `pdir`'s `deleted` record lists (`partition`: its name, None when
    none of its files was read back), then rewrite the record with those its put files still there hold."""
    dead = _deletes(dd, os.path.join(pdir, DELETED))
    if len(dead) and partition is not None:
        dd.adopting = ""  # (recorded already)
        try:
            admission.free(partition, dead.astype(np.int64))
        finally:
            dd.adopting = None
    try:
        dd.compact_deleted(pdir, dead)
    except OSError as e:  # (the old record stays: it lists more, samples of files gone, never handed out again)
        _not_rewritten(pdir, DELETED, e)


def _not_rewritten(pdir: str, name: str, e: OSError) -> None:
    logger.warning("[datadir] could not rewrite %s in %s at start (%s): the old one is kept, whole, and rewritten "
                   "at the next start; free room on that disk", name, pdir, e.strerror or e)


def _deletes(dd: DataDir, path: str) -> np.ndarray:
    """The samples recorded deleted in a partition dir's DELETED file (a torn last record is left out)."""
    return _record(dd, path, "the deletes it recorded are not applied again (the controller frees the deleted "
                             "samples it knows of when this warehouse rejoins)")


def _record(dd: DataDir, path: str, without: str) -> np.ndarray:
    """The int64 records of a partition dir's record file (a torn last one left out; none when there is no
    file). One that is not a regular file (a fifo: never opened blocking) refuses the start; with
    --drop-damaged-files it is moved aside and read as empty, the error line saying what that means
    (`without`)."""
    try:
        return dir_records.read(path)
    except FileNotFoundError:
        return np.empty(0, dtype="<i8")
    except Damaged as d:
        if not dd.drop_damaged:
            raise damaged(dd, path, d.why) from None
        logger.error("[datadir] moved damaged file=%s to=%s: %s; %s", path, _aside(dd, path), d.why, without)
        return np.empty(0, dtype="<i8")


def _drop(dd: DataDir, path: str, d: Damaged, answered: bool) -> None:
    """A put file that failed its check: refuse the start, naming it; with --drop-damaged-files move it
    aside and keep what it held for `report`, with an error line saying what becomes of its samples
    (`answered`: the partition's `committed` record lists it)."""
    if not dd.drop_damaged:
        raise damaged(dd, path, d.why)
    moved = _aside(dd, path)
    if d.held is not None:
        dd.lost.append(d.held)
        ix = d.held.indexes
        logger.error("[datadir] moved damaged file=%s to=%s: %s; its %d samples are gone from this warehouse: %s: "
                     "partition=%r columns=%s indexes=%s%s", path, moved, d.why, len(ix), _fate(d.meta, answered),
                     d.held.partition, ",".join(d.held.columns), ix[:32].tolist(), " ..." if len(ix) > 32 else "")
    else:
        dd.lost_unknown.append(moved)
        logger.error("[datadir] moved damaged file=%s to=%s: %s; it is too damaged to say which samples it held, "
                     "so every value the controller records on this warehouse that the restart did not bring "
                     "back is reported lost (DockDataLost, unless a replica holds it)", path, moved, d.why)


_LOST = "reported lost (DockDataLost, unless a replica holds them)"


def _fate(meta: dict | None, answered: bool) -> str:
    """What readers see of a dropped file's samples: lost where the controller recorded them (a put committed
    before it was answered, or whose early commit was answered); holes, never delivered, where it did not."""
    if meta is None:
        return (f"{_LOST} where the controller recorded them; if it was a put answered before its commit "
                "(--commit-window) whose commit never reached the controller, they are holes, never delivered")
    if not meta.get("block"):
        return _LOST
    if answered:
        return f"a put answered before its commit, whose commit the controller answered: {_LOST}"
    return (f"a put answered before its commit, whose commit is not recorded answered and is not sent again: if "
            f"the controller applied it they are {_LOST}, else they are holes of block {meta['block']}, never "
            "delivered to any reader")


def _aside(dd: DataDir, path: str) -> str:
    """Move a damaged file into DIR/damaged (kept as evidence, never read again); where it is now."""
    aside = os.path.join(dd.path, DAMAGED)
    os.makedirs(aside, mode=0o700, exist_ok=True)
    base = os.path.join(aside, f"{os.path.basename(os.path.dirname(path))}.{os.path.basename(path)}")
    dest, k = base, 0
    while os.path.lexists(dest):
        k += 1
        dest = f"{base}.{k}"
    os.rename(path, dest)
    return dest


def report(dd: DataDir, reg: pb.RegisterWarehouse) -> None:
    """For the first rejoin after the start: the samples of the files dropped as damaged, lost (not
    unwritten, as values the restart lacks otherwise are), or that some dropped file held samples
    nobody can name any more."""
    for name, cols in putfile.columns_of(dd.lost).items():
        inv = reg.lost.add(name=name)
        for col, idx in cols.items():
            inv.columns.add(name=col, runs=_runs(idx))
    reg.lost_unknown = bool(dd.lost_unknown)


def _not_a_dir(dd: DataDir, path: str) -> DockDataDirError:
    if os.path.islink(path):
        target = os.path.realpath(path)
        return DockDataDirError(
            f"--data-dir {dd.path}: {path} is a symbolic link (to {target}), not a partition directory of the "
            "dir: a data dir's files move between it and its partition dirs by rename, so they must all live "
            f"in it, on one filesystem. Move it back (rm {path} && mv {target} {path}), or move the whole "
            "--data-dir to the other disk, then start again")
    return DockDataDirError(f"--data-dir {dd.path}: {path} is not a directory (a partition dir's name); move "
                            "it out of the dir and start again")


def damaged(dd: DataDir, path: str, why: str) -> DockDataDirError:
    return DockDataDirError(
        f"--data-dir: {path} is damaged: {why}. Start with --drop-damaged-files to move it aside (into "
        f"{os.path.join(dd.path, DAMAGED)}) and start without it: the samples it held are then reported "
        "lost (DockDataLost), not dropped in silence. Or put back an intact copy of the file")
