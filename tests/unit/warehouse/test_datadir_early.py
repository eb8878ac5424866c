"""A data dir's files of puts answered before their commit (--commit-window): each keeps its commit (block,
put id, tags, token), and a start makes that commit again for every such file its partition's `committed`
record does not list, as the put pipeline made it; the record is compacted to the files still there.
In process, through the same adoption a restart runs."""

from __future__ import annotations

import os

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd.warehouse import datadir, dir_records
from dockd.warehouse.commit import commit_request
from dockd.warehouse.datadir import COMMITTED, DataDir
from dockd.warehouse.putfile import part_dir
from tests.unit.warehouse.test_datadir import DOCK, _adopted, _put


def test_a_start_commits_again_the_early_puts_not_recorded_committed(tmp_path):
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 10)
    dd.stored("p", np.array([8, 9]), cols, body, len(body), 1, 60)  # (committed before its file was written)
    rooms = []
    for k in range(4):
        room = dd.room("p", cols, len(body), 2)
        assert room is not None
        room.commit = pb.CommitRequest(block=7, put_id=100 + k, tags=[pb.Tag(name="age", values=[k, k])])
        dd.stored("p", np.array([2 * k, 2 * k + 1]), cols, body, len(body), 1, 50 + k, room)
        rooms.append(room)
    dd.committed(rooms[1].file)
    dd.committed(rooms[3].file)
    dd.remove(rooms[3].file)  # (its samples all gone since: a start gives its number to the next file)
    dd.close()
    wh, again = _adopted(dd.path)
    got = {c.put_id: (path, c) for path, c in again.uncommitted}
    assert sorted(got) == [100, 102]
    path, c = got[102]
    assert path == rooms[2].file
    put = pb.PutRequest(partition="p", indexes=[4, 5], columns=cols, token=52, group_size=1,
                        tags=[pb.Tag(name="age", values=[2, 2])])
    want = commit_request(put, len(body), 3)
    want.block, want.put_id = 7, 102
    assert c == want and not c.has_timeout and not c.new_count
    listed = dir_records.read(os.path.join(dd.path, part_dir("p"), COMMITTED)).tolist()
    number = [int(os.path.basename(r.file)[:-4], 16) for r in rooms]
    assert listed == [number[1]] and again.next_file == number[3]  # (compacted: the next file's number is not listed)


def _early_put(dd: DataDir, partition: str, k: int, cols, body) -> str:
    room = dd.room(partition, cols, len(body), 2)
    assert room is not None
    room.commit = pb.CommitRequest(block=7, put_id=1000 + k)
    return dd.stored(partition, np.array([2 * k, 2 * k + 1]), cols, body, len(body), 1, 0, room)


def test_a_number_a_committed_record_lists_of_a_file_gone_is_not_taken_as_committed_by_the_next_file(tmp_path):
    """A start compacts every partition's `committed` record, also one whose early puts are all gone: the
    numbers of files gone are given to the next files written, whose commits are not answered yet."""
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 10)
    dd.stored("q", np.array([0, 1]), cols, body, len(body), 1, 0)  # (another partition's file stays)
    for k in range(3):  # answered, committed, consumed: their files removed
        path = _early_put(dd, "p", k, cols, body)
        dd.committed(path)
        dd.remove(path)
    dd.close()
    _, again = _adopted(dd.path)  # (a restart: the next file takes number 2 again)
    again.open()
    fresh = [_early_put(again, "p", 10 + k, cols, body) for k in range(3)]  # answered; killed before the window
    again.close()
    _, third = _adopted(dd.path)
    assert sorted(path for path, _ in third.uncommitted) == sorted(fresh)


def test_the_committed_record_stays_small_in_a_long_stream_of_puts_consumed(tmp_path, monkeypatch):
    """Records of files since removed are dropped while the warehouse runs, not only at its next start."""
    monkeypatch.setattr(datadir, "COMPACT_AT", 16, raising=False)
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 10)
    live, waiting = [], []
    for k in range(300):
        path = _early_put(dd, "p", k, cols, body)
        if k % 100 == 7:
            waiting.append(path)  # (its commit not answered)
            continue
        dd.committed(path)
        if k % 50 == 3:
            live.append(path)  # (its samples not consumed)
        else:
            dd.remove(path)
    record = os.path.join(dd.path, part_dir("p"), COMMITTED)
    assert os.path.getsize(record) <= 8 + 16 * 2 * 16  # (300 puts: 4,808 bytes when only a start compacts it)
    dd.close()
    _, again = _adopted(dd.path)
    assert sorted(path for path, _ in again.uncommitted) == sorted(waiting)
    assert sorted(dir_records.read(record).tolist()) == sorted(int(os.path.basename(p)[:-4], 16)
                                                                       for p in live)


def test_a_put_file_named_by_hand_is_committed_and_removed_like_the_others(tmp_path):
    """A file not named as dockd names them (copied in by hand) is read back, sent again, and when its commit
    is answered and its samples are gone, nothing fails: it is only never listed (sent again at each start)."""
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 10)
    dd.committed(_early_put(dd, "p", 0, cols, body))
    path = _early_put(dd, "p", 1, cols, body)
    odd = os.path.join(os.path.dirname(path), "copied.put")
    os.rename(path, odd)
    dd.close()
    _, again = _adopted(dd.path)
    assert [p for p, _ in again.uncommitted] == [odd]
    again.committed(odd)
    again.remove(odd)
    assert not os.path.exists(odd)


def test_a_commit_answered_that_cannot_be_recorded_is_logged_and_sent_again_at_the_next_start(tmp_path, caplog):
    """Recording an answered commit is not what the put's answer waits on: when the record cannot be written
    (a full disk; here its path is a dir) the warehouse says so and goes on, and a start sends it again."""
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    dd.joined(3, 0, [])
    cols, body = _put(2, 10)
    path = _early_put(dd, "p", 0, cols, body)
    record = os.path.join(os.path.dirname(path), COMMITTED)
    os.mkdir(record)
    with caplog.at_level("WARNING", logger="dockd.warehouse.datadir"):
        dd.committed(path)
    assert "could not record the answered commit" in caplog.text
    os.rmdir(record)
    dd.close()
    _, again = _adopted(dd.path)
    assert [p for p, _ in again.uncommitted] == [path]
