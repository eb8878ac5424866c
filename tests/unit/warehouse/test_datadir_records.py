"""A data dir's `deleted` record stays at the size of what its partition dir holds: a long stream of
samples deleted, their puts' files removed, has it rewritten with the samples of the files still there
(while the warehouse runs and at start), and a start after any number of rewrites frees exactly the
samples deleted; a rewrite cut short by a kill leaves the record it replaces. A file dropped as damaged
(--drop-damaged-files) is logged with what readers see of its samples: lost where the controller
recorded them, holes where a put answered before its commit never reached it. In process, through the
same adoption a restart runs."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.warehouse import datadir, dir_records
from dockd.warehouse.datadir import DELETED, DataDir
from dockd.warehouse.putfile import part_dir
from tests.unit.warehouse.test_datadir import DOCK, _adopted, _flip, _put


def _held(wh, partition: str, upto: int) -> list[int]:
    part = wh.parts.get(partition)
    if part is None:
        return []
    return np.flatnonzero(part.columns["x"].present(np.arange(upto))).tolist()


def _record(dd: DataDir, partition: str) -> list[int]:
    path = os.path.join(dd.path, part_dir(partition), DELETED)
    return sorted(dir_records.read(path).tolist()) if os.path.exists(path) else []


def test_the_deleted_record_stays_small_in_a_long_stream_and_a_start_frees_exactly_the_deleted(tmp_path,
                                                                                               monkeypatch):
    """Each put's first half is deleted with it, its second half with the next put (its file then removed),
    except every 25th put's, which stays: 300 puts grew the record by 8 bytes a sample deleted (4,800 bytes),
    and a start read it all; now it is rewritten once past 16 records and the samples its files hold."""
    monkeypatch.setattr(datadir, "COMPACT_AT", 16)
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(4, 10)
    prev, alive, sizes = None, [], []
    for k in range(300):
        path = dd.stored("p", np.arange(4 * k, 4 * k + 4), cols, body, len(body), 1, 0)
        dd.deleted("p", np.array([4 * k, 4 * k + 1]))  # (its file still holds the other two)
        if prev is not None:
            dd.deleted("p", np.array([4 * k - 2, 4 * k - 1]))
            dd.remove(prev)
        prev = path
        if k % 25 == 3:
            alive.append(k)
            prev = None  # (its second half is never deleted: its file stays)
        sizes.append(os.path.getsize(os.path.join(dd.path, part_dir("p"), DELETED)))
    kept = [i for k in alive + [299] for i in (4 * k, 4 * k + 1)]  # (deleted samples of files still there)
    assert max(sizes) <= 8 + 16 * 2 * (16 + 4 + 2 * len(alive)), max(sizes)  # (9,608 bytes when only appended)
    assert set(_record(dd, "p")) >= set(kept)  # (all the deletes of files still there: none dropped)
    dd.close()

    wh, again = _adopted(dd.path)
    assert _held(wh, "p", 1200) == sorted(i for k in alive + [299] for i in (4 * k + 2, 4 * k + 3))
    assert _record(again, "p") == sorted(kept)  # (a start keeps those only)
    wh, _ = _adopted(dd.path)  # (and a start after that rewrite frees the same)
    assert _held(wh, "p", 1200) == sorted(i for k in alive + [299] for i in (4 * k + 2, 4 * k + 3))


def test_a_start_removes_the_record_of_a_partition_dir_whose_files_are_all_gone(tmp_path):
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(4, 10)
    path = dd.stored("p", np.arange(4), cols, body, len(body), 1, 0)
    dd.deleted("p", np.array([0, 1]))
    dd.remove(path)  # (the kill came before its other samples' delete was recorded: the file went with them)
    dd.stored("q", np.arange(4), cols, body, len(body), 1, 0)
    dd.close()
    assert _record(dd, "p") == [0, 1]
    wh, again = _adopted(dd.path)
    assert _record(again, "p") == [] and _held(wh, "q", 4) == [0, 1, 2, 3]


def test_a_rewrite_cut_short_leaves_the_record_it_replaces(tmp_path, monkeypatch):
    """A kill while the new record is written (its temporary file left, torn) or before its rename: the
    start reads the old record, whole, and frees every sample it lists."""
    monkeypatch.setattr(datadir, "COMPACT_AT", 4)
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(4, 10)
    a = dd.stored("p", np.arange(4), cols, body, len(body), 1, 0)
    b = dd.stored("p", np.arange(4, 8), cols, body, len(body), 1, 0)
    killed, real = RuntimeError("killed before the rename"), os.rename

    def rename(src, dst):
        if not src.endswith(f".{DELETED}.new"):
            return real(src, dst)
        with open(src, "r+b") as f:  # (what a kill halfway through the write leaves)
            f.truncate(5)
        raise killed

    monkeypatch.setattr(datadir.dir_records.os, "rename", rename)
    dd.deleted("p", np.array([0, 1, 4]))
    dd.deleted("p", np.array([2, 5]))  # (5 records: the files hold 8)
    dd.remove(a)
    with pytest.raises(RuntimeError) as e:
        dd.deleted("p", np.array([100, 101, 102, 103, 104]))  # (due: 10 records, the files hold 4)
    assert e.value is killed
    monkeypatch.undo()
    pdir = os.path.join(dd.path, part_dir("p"))
    assert not os.path.exists(os.path.join(pdir, f".{DELETED}.new"))  # (removed on the error...)
    with open(os.path.join(pdir, f".{DELETED}.new"), "wb") as f:
        f.write(b"\x01\x02\x03")  # (... left torn by a kill: never read)
    dd.close()
    wh, again = _adopted(dd.path)
    assert _held(wh, "p", 8) == [6, 7] and _record(again, "p") == [4, 5]
    assert os.path.exists(b)


def _early(dd: DataDir, partition: str, idx, block: int) -> str:
    cols, body = _put(len(idx), 1000)
    room = dd.room(partition, cols, len(body), len(idx))
    assert room is not None
    room.commit = pb.CommitRequest(block=block, put_id=block)
    return dd.stored(partition, np.array(idx), cols, body, len(body), 1, 0, room)


def test_a_dropped_file_is_logged_with_what_readers_see_of_its_samples(tmp_path, caplog):
    """A put committed before it was answered, or answered before its commit and that commit answered:
    lost. Answered before its commit, its commit not recorded answered: holes if the controller never
    applied it (it is not sent again)."""
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 1000)
    files = {"plain": dd.stored("p", np.array([0, 1]), cols, body, len(body), 1, 0),
             "answered": _early(dd, "p", [2, 3], 7), "unanswered": _early(dd, "p", [4, 5], 8)}
    dd.committed(files["answered"])
    dd.close()
    for path in files.values():
        _flip(path, os.path.getsize(path) - 1)
    with caplog.at_level(logging.ERROR, logger="dockd.warehouse.readback"):
        _, again = _adopted(dd.path, drop=True)
    lines = {what: [r.getMessage() for r in caplog.records if path in r.getMessage()] for what, path in files.items()}
    assert all(len(v) == 1 for v in lines.values()), lines
    lost = "reported lost (DockDataLost"
    assert lost in lines["plain"][0] and "hole" not in lines["plain"][0]
    assert lost in lines["answered"][0] and "hole" not in lines["answered"][0]
    assert "holes of block 8, never delivered" in lines["unanswered"][0] and "if the controller applied it" in \
        lines["unanswered"][0]
    assert not again.uncommitted  # (a dropped file's commit is not sent again)
