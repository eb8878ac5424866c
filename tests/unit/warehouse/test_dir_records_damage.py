"""A data dir's `committed` and `deleted` records when the disk damages them or is full.

A corrupted or torn `committed` record must never make the commit of a put answered before its commit look
answered (it would never be sent: the put lost); at worst a commit is sent again (answered as applied). A
corrupted `deleted` record must never free a sample nobody deleted. A delete that cannot be appended (a
full disk) must not fail the free that made it: the samples are freed, and the delete is recorded with
the next one. In process, through the same adoption a restart runs."""

from __future__ import annotations

import errno
import os

import numpy as np
import pyarrow as pa

from dockd.warehouse import dir_records
from dockd.warehouse.core import Warehouse
from dockd.warehouse.datadir import COMMITTED, DELETED, DataDir
from dockd.warehouse.putfile import part_dir
from tests.unit.warehouse.test_datadir import DOCK, _adopted, _put
from tests.unit.warehouse.test_datadir_early import _early_put


def _six_early_puts(tmp_path) -> tuple[str, str, set[str]]:
    """A data dir with six puts answered before their commit, the commits of the 1st, 3rd and 5th answered;
    (its path, the `committed` record, the files whose commit was not answered)."""
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 10)
    unsent = set()
    for k in range(6):
        path = _early_put(dd, "p", k, cols, body)
        if k % 2 == 0:
            dd.committed(path)
        else:
            unsent.add(path)
    dd.close()
    return dd.path, os.path.join(dd.path, part_dir("p"), COMMITTED), unsent


def test_no_corruption_of_the_committed_record_makes_an_unsent_commit_look_sent(tmp_path):
    """Every byte flipped (each bit of it, and all of it), every length it may be torn at, every entry zeroed:
    the start sends the commit of every put whose commit was not answered (before, one bit flipped in an
    entry made it another file's number: that file's commit was never sent, its put lost)."""
    path, record, unsent = _six_early_puts(tmp_path)
    with open(record, "rb") as f:
        whole = f.read()
    variants = [whole[:n] for n in range(len(whole))]
    for at in range(len(whole)):
        for mask in (1, 2, 4, 8, 16, 32, 64, 128, 255):
            variants.append(whole[:at] + bytes([whole[at] ^ mask]) + whole[at + 1:])
    for at in range(0, len(whole), 8):
        variants.append(whole[:at] + bytes(16) + whole[at + 16:])
    for raw in variants:
        with open(record, "wb") as f:
            f.write(raw)
        _, again = _adopted(path)
        sent_again = {p for p, _ in again.uncommitted}
        assert sent_again >= unsent, (raw.hex(), sorted(unsent - sent_again))


def test_a_failed_append_is_cut_back_and_never_followed_by_half_an_entry(tmp_path, monkeypatch):
    """Half an entry written, then the disk is full: the append fails and is cut back off, so the entries
    appended once there is room again read back whole (before, the next ones followed the half entry and
    each read back as two halves of others)."""
    record = str(tmp_path / "r")
    dir_records.append(record, np.array([5, 6], dtype=np.int64))
    real = os.write

    def short(fd, data):
        monkeypatch.setattr(dir_records.os, "write", _enospc)
        return real(fd, bytes(data)[: len(data) // 2 + 3])

    monkeypatch.setattr(dir_records.os, "write", short)
    try:
        dir_records.append(record, np.array([7], dtype=np.int64))
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        raise AssertionError("the append did not fail")
    monkeypatch.setattr(dir_records.os, "write", real)
    dir_records.append(record, np.array([8, 9], dtype=np.int64))
    assert dir_records.read(record).tolist() == [5, 6, 8, 9]


def test_an_entry_torn_by_a_power_cut_is_cut_off_by_the_next_append(tmp_path):
    record = str(tmp_path / "r")
    dir_records.append(record, np.array([1, 2], dtype=np.int64))
    with open(record, "ab") as f:
        f.write(b"\x07" * 5)  # (a power cut in the middle of an append)
    assert dir_records.read(record).tolist() == [1, 2]
    dir_records.append(record, np.array([3], dtype=np.int64))
    assert dir_records.read(record).tolist() == [1, 2, 3]


def test_a_record_of_the_format_before_is_read_and_rewritten_at_the_next_append(tmp_path):
    record = str(tmp_path / "r")
    with open(record, "wb") as f:
        f.write(np.array([4, 9], dtype="<i8").tobytes() + b"\x01\x02")  # (bare int64s, a torn last one)
    assert dir_records.read(record).tolist() == [4, 9]
    dir_records.append(record, np.array([11], dtype=np.int64))
    with open(record, "rb") as f:
        assert f.read(len(dir_records.MAGIC)) == dir_records.MAGIC
    assert dir_records.read(record).tolist() == [4, 9, 11]


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_delete_that_cannot_be_recorded_frees_its_samples_and_goes_with_the_next(tmp_path, caplog):
    """The `deleted` record cannot be appended to (a full disk; here its path is a dir): the free goes through
    (before, the error was raised into it after the samples were unlinked and before their put was dropped:
    the controller's free failed, and was sent again to free nothing), says so, and the delete is recorded
    with the next one, so a start frees both."""
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    wh = Warehouse(1 << 30)
    wh.keeper = dd
    cols, body = _put(4, 10)
    for k in range(3):
        wh.reserve(len(body))
        wh.store("p", np.arange(4 * k, 4 * k + 4), cols, pa.py_buffer(body), len(body), group_size=1)
    record = os.path.join(dd.path, part_dir("p"), DELETED)
    os.mkdir(record)
    with caplog.at_level("WARNING", logger="dockd.warehouse.dir_records"):
        freed, _ = wh.free_samples("p", np.array([0, 1, 4, 5, 6, 7]))  # half of the first put, the second whole
    assert freed and "could not record the delete of 6 samples" in caplog.text and "Free room" in caplog.text
    assert not wh.has("p", [("x", [0])]) and not wh.has("p", [("x", [7])]) and wh.has("p", [("x", [2])])
    os.rmdir(record)
    wh.free_samples("p", np.array([8]))
    assert sorted(dir_records.read(record).tolist()) == [0, 1, 8]  # (those of files still there)
    dd.close()
    again, _ = _adopted(dd.path)
    held = [i for i in range(12) if again.has("p", [("x", [i])])]
    assert held == [2, 3, 9, 10, 11]
