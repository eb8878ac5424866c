"""A data dir's files of puts answered before their commit (--commit-window): each keeps its commit (block,
put id, tags, token), and a start makes that commit again for every such file its partition's `committed`
record does not list, as the put pipeline made it; the record is compacted to the files still there.
In process, through the same adoption a restart runs."""

from __future__ import annotations

import os

import numpy as np

from dockd._proto import dockd_pb2 as pb
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
    listed = np.fromfile(os.path.join(dd.path, part_dir("p"), COMMITTED), dtype="<i8").tolist()
    number = [int(os.path.basename(r.file)[:-4], 16) for r in rooms]
    assert listed == [number[1]] and again.next_file == number[3]  # (compacted: the next file's number is not listed)
