"""A data dir's put files, written and read back in process: a put whose body is written into its
room before its commit and one whose header does not fit in front of it (written whole instead)
come back bit-exact through the same adoption a restart runs; so do files of the older formats 1
and 2. A flipped byte anywhere in a file (its header included) refuses the adoption naming the
file; a fifo is refused without blocking; --drop-damaged-files moves such a file aside and keeps
what it held for the controller, or says it cannot. One process per dir (the lock)."""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib

import numpy as np
import pytest

from dockd import dirlock
from dockd._proto import dockd_pb2 as pb
from dockd.warehouse import readback
from dockd.warehouse.admission import Admission
from dockd.warehouse.core import Warehouse
from dockd.warehouse.datadir import DataDir, DockDataDirError
from dockd.warehouse.putfile import Room
from dockd.warehouse.segments import Segments

DOCK = {"token": "", "controller": "127.0.0.1:1"}


class _Tokens:
    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def done(self, token: int, indexes: list[int]) -> None:
        self.seen[token] = indexes


def _put(n: int, values: int) -> tuple[list[pb.ColumnData], bytes]:
    body = np.arange(n * values, dtype=np.float32).tobytes()
    col = pb.ColumnData(name="x", runs=[pb.Run(dtype="float32", shape=[values], count=n, nbytes=len(body))])
    return [col], body


def _adopted(path: str, *, drop: bool = False) -> tuple[Warehouse, DataDir]:
    wh = Warehouse(1 << 30)
    again = DataDir(path, DOCK, drop_damaged=drop)
    again.open()
    wh.keeper = again
    try:
        readback.adopt(again, wh, Admission(wh, Segments(keep_bytes=0), lambda: 0), _Tokens())
    finally:
        again.close()
    return wh, again


def _read(wh: Warehouse, partition: str, idx: list[int]) -> bytes:
    (name, slices), = wh.fetch(partition, [("x", idx)])
    return b"".join(bytes(batch.host(*batch.span(r0, r1))) for batch, r0, r1 in slices)


def _stored(tmp_path, partition: str = "p", idx=(5, 6, 7, 8)) -> tuple[DataDir, str, bytes]:
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(len(idx), 1000)
    path = dd.stored(partition, np.array(idx), cols, body, len(body), 1, 99)
    dd.close()
    return dd, path, body


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("fits", [True, False])
def test_a_body_written_before_the_commit_comes_back(tmp_path, fits):
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(4, 1000)
    room = dd.room("p", cols, len(body), 4)
    assert room is not None
    if not fits:  # a room too small for the header in front of the body: the put is written whole over it
        room = Room(room.path, len(body) + 16, len(body))
    dd.prewrite(room, body)
    assert room.crc_body is not None
    path = dd.stored("p", np.array([5, 6, 7, 8]), cols, body, len(body), 1, 99, room)
    dd.close()
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(12)[8:], "little") == 3
    wh, _ = _adopted(dd.path)
    assert _read(wh, "p", [5, 6, 7, 8]) == body


@pytest.mark.parametrize("fmt", [1, 2])
def test_files_of_the_older_formats_are_still_read(tmp_path, fmt):
    """Files written by dockd before format 3: the checksums in the JSON header (format 1: one of the
    runs and the body; 2: one each), which they do not cover."""
    dd, path, body = _stored(tmp_path)
    runs = pb.PutRequest(partition="p", indexes=[5, 6, 7, 8], columns=_put(4, 1000)[0]).SerializeToString()
    meta = {"dock": DOCK, "partition": "p", "group_size": 1, "token": 99}
    meta.update({"crc": zlib.crc32(body, zlib.crc32(runs))} if fmt == 1 else
                {"crc": zlib.crc32(runs), "crc_body": zlib.crc32(body)})
    head = json.dumps(meta).encode() + b"   "
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIIIQ", b"DOCKDPUT", fmt, len(head), len(runs), len(body)) + head + runs + body)
    wh, _ = _adopted(dd.path)
    assert _read(wh, "p", [5, 6, 7, 8]) == body
    # ... and one whose header names another partition than its dir is refused (the header is not covered)
    at = 28 + head.index(b'"p"') + 1  # (after the fixed header)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"q")
    with pytest.raises(DockDataDirError, match=os.path.basename(path)):
        _adopted(dd.path)


def test_a_flipped_byte_anywhere_refuses_the_adoption_naming_the_file(tmp_path):
    dd, path, body = _stored(tmp_path, partition="step-0")
    with open(path, "rb") as f:
        raw = f.read()
    name = raw.index(b'"step-0"') + 6
    for at in (9, 13, 17, 25, name, raw.index(b'"group_size"') + 14, len(raw) - len(body) - 20, len(raw) - 1):
        _flip(path, at)
        with pytest.raises(DockDataDirError, match=os.path.basename(path)):
            _adopted(dd.path)
        _flip(path, at)
    wh, _ = _adopted(dd.path)  # (each flipped back: whole again)
    assert _read(wh, "step-0", [5, 6, 7, 8]) == body


@pytest.mark.parametrize("name", ["00000000000000ff.put", "committed", "deleted"])
def test_a_fifo_is_refused_without_blocking(tmp_path, name):
    """A put file, or a partition dir's record of commits answered or of samples deleted."""
    dd, path, _ = _stored(tmp_path)
    fifo = os.path.join(os.path.dirname(path), name)
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def adopt() -> None:
        try:
            _adopted(dd.path)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=adopt, daemon=True)  # (a blocking open would hang it for ever)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the adoption blocked opening a fifo"
    assert len(errors) == 1 and "fifo" in str(errors[0]) and fifo in str(errors[0]), errors
    _adopted(dd.path, drop=True)  # --drop-damaged-files: moved aside, the start goes on
    assert not os.path.exists(fifo) and os.listdir(os.path.join(dd.path, "damaged"))


def test_dropping_damaged_files_keeps_what_they_held_for_the_controller(tmp_path):
    dd = DataDir(str(tmp_path / "d"), DOCK)
    dd.open()
    cols, body = _put(4, 1000)
    bad = dd.stored("p", np.array([0, 1, 2, 3]), cols, body, len(body), 1, 1)  # its body damaged
    dd.stored("p", np.array([4, 5, 6, 7]), cols, body, len(body), 1, 2)
    worse = dd.stored("q", np.array([0, 1, 2, 3]), cols, body, len(body), 1, 3)  # its runs damaged too
    dd.close()
    _flip(bad, os.path.getsize(bad) - 1)
    with open(worse, "r+b") as f:
        f.write(b"garbage!")
    wh, again = _adopted(dd.path, drop=True)
    assert _read(wh, "p", [4, 5, 6, 7]) == body and "q" not in wh.parts
    aside = sorted(os.listdir(os.path.join(dd.path, "damaged")))
    assert len(aside) == 2 and not os.path.exists(bad) and not os.path.exists(worse)
    reg = pb.RegisterWarehouse()
    readback.report(again, reg)
    assert [(p.name, [(c.name, list(c.runs)) for c in p.columns]) for p in reg.lost] == [("p", [("x", [0, 4])])]
    assert reg.lost_unknown  # (the q file said nothing)


def test_one_process_per_data_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(dirlock, "WAIT", 0.2)
    first = DataDir(str(tmp_path / "d"), DOCK)
    first.open()
    with open(tmp_path / "d" / "identity.json", "rb") as f:
        identity = f.read()
    second = DataDir(str(tmp_path / "d"), DOCK)
    with pytest.raises(DockDataDirError, match=f"in use by another dockd process \\(pid {os.getpid()}"):
        second.open()
    with open(tmp_path / "d" / "identity.json", "rb") as f:
        assert f.read() == identity  # refused before it wrote anything
    first.close()
    second.open()
    second.close()

