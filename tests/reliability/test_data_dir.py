"""A warehouse with a data dir (`dockd serve --join ... --data-dir DIR`) killed with SIGKILL and
started again on the same dir re-adopts every sample it acknowledged (issue 22, part 1): the
untaken ones reach their consumers bit-exact, nothing is reported lost or handed out twice, the
capacity figures are those it had; frees, retirement and clears delete the files; a dir of
another dock or user is refused with a message saying what to do; a torn temporary file is
ignored. A damaged file (its header included), a fifo named like a stored put, or a partition
dir replaced by a symbolic link refuse the start, naming the file; --drop-damaged-files starts
without damaged files and reports their samples lost. Real `dockd serve` processes on loopback."""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import dockd
from dockd.local import read_ready, spawn_node
from dockd.warehouse import dir_records
from dockd.warehouse.put import WRITE_OFF_LOOP
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)

BIG = 80_000  # float32 values per big sample: a put of several is received into a shared-memory segment


class Dock:
    """A controller without a warehouse of its own, and one warehouse with a data dir that joins it."""

    def __init__(self, data_dir: str, *extra: str) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)
        self.ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--warehouse-grace", "30"])
        self.address = f"127.0.0.1:{ready['port']}"
        self.wh: subprocess.Popen | None = None
        self.wh_address = ""
        try:
            self.start_warehouse()
        except BaseException:
            self.close()
            raise

    def start_warehouse(self, *extra: str, log: str = "") -> None:
        """Start the warehouse (again, at the port it had); `log`: a file for its stderr."""
        args = ["--join", self.address, "--data-dir", self.data_dir, "--capacity", "512MiB", *self.extra, *extra]
        args += ["--port", self.wh_address.rpartition(":")[2] if self.wh_address else "0"]
        if not log:
            self.wh, ready = spawn_node(args)
        else:
            with open(log, "wb") as err:
                self.wh = subprocess.Popen([sys.executable, "-m", "dockd", "serve", *args], stdout=subprocess.PIPE,
                                           stderr=err, stdin=subprocess.DEVNULL)
            ready = read_ready(self.wh)
        self.wh_address = f"127.0.0.1:{ready['port']}"

    def kill_warehouse(self) -> None:
        assert self.wh is not None
        self.wh.send_signal(signal.SIGKILL)
        self.wh.wait(10)
        assert self.wh.stdout is not None
        self.wh.stdout.close()

    def close(self) -> None:
        for p in (self.wh, self.ctrl):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
            if p is not None and p.stdout is not None:
                p.stdout.close()


@contextlib.contextmanager
def dock_with_data_dir(path: str, *extra: str):
    d = Dock(path, *extra)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def data_dir(tmp_path):
    """A fresh data dir on tmpfs when there is one (where it is meant to live), else under tmp_path."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    path = os.path.join(base, f"dockd-test-data-{os.getpid()}-{time.monotonic_ns()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def contents(n: int, seed: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": [torch.randn(BIG, generator=g) for _ in range(n)],                       # big: shared memory
        "r": [torch.randint(0, 1 << 30, (int(k) % 7 + 1,), generator=g) for k in range(n)],  # small, ragged
        "m": [{"seed": seed, "k": k, "s": "é" * (k % 5)} for k in range(n)],           # msgpack values
    }


def warehouse_stats(d: dockd.Dock, traffic: bool = False) -> dict:
    w = d.stats(traffic=traffic)["warehouses"]
    assert len(w) == 1, w
    return next(iter(w.values()))


def put_files(path: str) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".put"))


def test_restart_readopts_every_untaken_sample_bit_exact(data_dir):
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        sent = {}
        for seed in (1, 2):  # two puts of new samples, then a column added to all of them
            vals = contents(20, seed)
            for i, k in enumerate(d.put({"x": vals["x"], "r": vals["r"]}, partition="p")):
                sent[k] = {"x": vals["x"][i], "r": vals["r"][i], "m": vals["m"][i]}
        d.put({"m": [sent[k]["m"] for k in range(40)]}, partition="p", indexes=list(range(40)))
        taken = d.get("a", ["x", "r", "m"], 15, partition="p", timeout=10).indexes
        assert sorted(taken) == list(range(15))
        before = warehouse_stats(d)
        files = put_files(data_dir)
        assert len(files) == 3

        dk.kill_warehouse()
        dk.start_warehouse()

        after = warehouse_stats(d)
        assert after["state"] == "joined" and after["bytes"] == before["bytes"], (before, after)
        got = d.get("a", ["x", "r", "m"], 25, partition="p", timeout=20)
        assert sorted(got.indexes) == list(range(15, 40))
        for pos, k in enumerate(got.indexes):
            assert torch.equal(got["x"][pos], sent[k]["x"]) and got["x"][pos].dtype == torch.float32
            assert torch.equal(got["r"][pos], sent[k]["r"]) and got["r"][pos].dtype == torch.int64
            assert got["m"][pos] == sent[k]["m"]
        with pytest.raises(dockd.DockTimeout):  # nothing confirmed comes again
            d.get("a", ["x"], 1, partition="p", timeout=1)
        every = d.get("b", ["x", "r", "m"], 40, partition="p", timeout=20)  # a new consumer: all 40, none lost
        assert sorted(every.indexes) == list(range(40))
        for pos, k in enumerate(every.indexes):
            assert torch.equal(every["x"][pos], sent[k]["x"]) and every["m"][pos] == sent[k]["m"]
        st = d.stats()
        assert "lost" not in str(st["warehouses"]), st["warehouses"]

        assert put_files(data_dir) == files

        # the restarted warehouse counts exactly what it held: a clear gives it all back, files included
        d.clear("p")
        wait_until(lambda: not put_files(data_dir), 10, "the cleared partition's files to go")
        assert not [n for n in os.listdir(data_dir) if n.startswith("p-")]
        assert warehouse_stats(d, traffic=True)["bytes"] == 0


def test_capacity_figures_survive_the_restart(data_dir):
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        d.put(contents(12, 3), partition="q")
        d.put(contents(3, 4), partition="q2")
        d.delete("q", [0, 1, 2])  # deleted values its put still holds: reclaimable
        wait_until(lambda: _figures(d)["reclaimable_bytes"] > 0, 10, "the delete to reach the warehouse")
        before = _figures(d)
        dk.kill_warehouse()
        dk.start_warehouse()
        after = _figures(d)
        assert after == before and after["bytes"] > 12 * BIG * 4, (before, after)


def _figures(d: dockd.Dock) -> dict:
    """The warehouse's own figures (asked of it): capacity, used, bookkeeping, reclaimable."""
    w = wait_until(lambda: (lambda w: w if "metadata_bytes" in w else None)(warehouse_stats(d, traffic=True)), 10,
                   "the warehouse to answer")  # (the client's old connection to it is found closed first)
    return {k: w[k] for k in ("bytes", "capacity", "metadata_bytes", "reclaimable_bytes", "state")}


def test_deletes_and_retirement_remove_files_and_stay_deleted(data_dir):
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        d.create_partition("r", retire_when_consumed_by=["t"])
        d.put({"x": torch.arange(10)}, partition="r")   # retired whole by consumer t
        d.put(contents(8, 5), partition="r")            # half deleted: its file stays, the deletes are recorded
        assert len(put_files(data_dir)) == 2
        whole = warehouse_stats(d)["bytes"]
        assert sorted(d.get("t", ["x"], 10, partition="r", timeout=10).indexes) == list(range(10))
        d.delete("r", [10, 11, 12, 13])
        wait_until(lambda: len(put_files(data_dir)) == 1, 10, "the retired put's file to go")
        # ... and the delete's free answered (half of the second put goes: it is compacted), which the restart
        # must find; under load its answer came after the file went, and a figure read before it did not match
        used = wait_until(lambda: (lambda b: b if b < 3 * whole // 4 else 0)(warehouse_stats(d)["bytes"]), 10,
                          "the delete's free to be answered")

        dk.kill_warehouse()
        dk.start_warehouse()

        assert warehouse_stats(d)["bytes"] == used
        got = d.get("u", ["x"], 4, partition="r", timeout=10)
        assert sorted(got.indexes) == [14, 15, 16, 17]
        with pytest.raises(dockd.DockTimeout):
            d.get("u", ["x"], 1, partition="r", timeout=1)
        d.delete("r", [14, 15, 16, 17])
        wait_until(lambda: not put_files(data_dir), 10, "the fully deleted put's file to go")

        # a later put is written over a freed put's file: it comes back whole after a restart too
        assert [n for n in os.listdir(data_dir) if n.startswith(".free-")]
        vals = contents(6, 7)
        idx = d.put(vals, partition="r2")
        dk.kill_warehouse()
        dk.start_warehouse()
        assert not [n for n in os.listdir(data_dir) if n.startswith(".free-")]
        got = d.get("u", ["x", "r", "m"], 6, partition="r2", timeout=10)
        for pos, k in enumerate(got.indexes):
            i = idx.index(k)
            assert torch.equal(got["x"][pos], vals["x"][i]) and torch.equal(got["r"][pos], vals["r"][i])
            assert got["m"][pos] == vals["m"][i]


def test_a_long_stream_of_deletes_keeps_the_deleted_record_small_and_a_restart_frees_exactly_them(data_dir):
    """Each put's first half is deleted with it, its second half with the next put (its file then removed),
    except every 20th put's, which stays: 120 puts of 64 samples grew the partition dir's `deleted` record by
    8 bytes a sample deleted (59,648 bytes, read whole by each start); it is rewritten with the samples of
    the files still there once it holds 4,096 records, and a restart after that frees exactly the samples
    deleted."""
    deleted_record = os.path.join(data_dir, "p-" + hashlib.sha1(b"s").hexdigest(), "deleted")
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        prev: list[int] = []
        stays: list[list[int]] = []
        for k in range(120):
            idx = d.put({"x": torch.arange(64 * k, 64 * k + 64)}, partition="s")
            d.delete("s", idx[:32] + prev[32:])
            prev = idx
            if k % 20 == 5:
                stays.append(idx)
                prev = []
        stays.append(prev)
        wait_until(lambda: len(put_files(data_dir)) == len(stays), 10, "the deleted puts' files to go")
        assert os.path.getsize(deleted_record) <= 8 + 16 * 4096  # (119,304 bytes when only appended)

        dk.kill_warehouse()
        dk.start_warehouse()
        # the start rewrote it with the deleted samples of the files still there, and freed exactly those
        assert sorted(dir_records.read(deleted_record).tolist()) == sorted(i for s in stays for i in s[:32])
        want = sorted(i for s in stays for i in s[32:])
        got = d.get("c", ["x"], len(want), partition="s", timeout=10)
        assert sorted(got.indexes) == want
        assert [int(v) for v in got["x"]] == list(got.indexes)  # (x was put as its own index)
        with pytest.raises(dockd.DockTimeout):
            d.get("c", ["x"], 1, partition="s", timeout=1)


def test_back_after_the_grace_period(data_dir):
    """Past --warehouse-grace the controller declared it lost: a consumer that met its samples then
    does not get them again; once it is back, every other consumer does."""
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        dk.ctrl.terminate()  # (a controller with a short grace instead)
        dk.ctrl.wait(20)
        assert dk.ctrl.stdout is not None
        dk.ctrl.stdout.close()
        port = dk.address.rpartition(":")[2]
        dk.ctrl, _ = spawn_node(["--controller", "--no-warehouse", "--port", port, "--warehouse-grace", "1"])
        wait_until(lambda: [w["state"] for w in d.stats()["warehouses"].values()] == ["joined"], 20,
                   "the warehouse to join the new controller")
        d.put({"x": torch.arange(6)}, partition="g")
        dk.kill_warehouse()
        wait_until(lambda: warehouse_stats(d)["state"] == "lost", 10, "the controller to give up on it")
        with pytest.raises(dockd.DockDataLost):
            d.get("early", ["x"], 6, partition="g", timeout=5)
        dk.start_warehouse()
        assert warehouse_stats(d)["state"] == "joined"
        got = d.get("late", ["x"], 6, partition="g", timeout=10)
        assert sorted(got.indexes) == list(range(6)) and sorted(int(v) for v in got["x"]) == list(range(6))
        with pytest.raises(dockd.DockTimeout):  # the samples it met while they were lost are gone for it
            d.get("early", ["x"], 1, partition="g", timeout=1)


def test_a_torn_temporary_file_is_ignored(data_dir):
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        d.put({"x": torch.arange(6)}, partition="t")
        dk.kill_warehouse()
        (part,) = [n for n in os.listdir(data_dir) if n.startswith("p-")]
        torn = os.path.join(data_dir, part, ".00000000000000ff.tmp")
        with open(torn, "wb") as f:
            f.write(b"DOCKDPUT\x01\x00\x00\x00half a put")
        dk.start_warehouse()
        assert not os.path.exists(torn)
        assert sorted(d.get("c", ["x"], 6, partition="t", timeout=10).indexes) == list(range(6))
        assert d.stats()["partitions"]["t"]["samples"] == 6


def test_a_restarted_durable_warehouse_lacking_a_commit_unwrites_it():
    """The kill came between a commit and its file: the values the controller recorded are unwritten
    again (the put was never acknowledged), not lost; a warehouse without a data dir loses them."""
    import numpy as np

    from dockd.controller.core import Controller
    from dockd.controller.warehouses import DURABLE_REJOIN, Inventory

    for known, lost in ((DURABLE_REJOIN, False), (True, True)):
        core = Controller()
        core.commit("p", ["x"], warehouse=1, new_count=4, nbytes=40)
        core.commit("p", ["x"], warehouse=1, new_count=4, nbytes=40)  # (its file never made it)
        core.commit("p", ["y"], warehouse=1, indexes=[0, 1], nbytes=20)  # (nor this one's)
        assert core.ready_count("p", "c", ["x"]) == 8
        held = Inventory(1, 40, {"x": np.arange(4, dtype=np.int64)})
        core.rejoin(1, {"p": held}, known=known)
        if lost:
            with pytest.raises(dockd.DockDataLost):
                core.locate("p", [4], ["x"])
            continue
        assert core.ready_count("p", "c", ["x"]) == 4  # samples 4..7 have no value: not offered, not lost
        assert core.ready_count("p", "c", ["x", "y"]) == 0
        assert core.locate("p", [0, 1, 2, 3], ["x"]).tolist() == [[1, 1, 1, 1]]
        with pytest.raises(dockd.DockNotFound):
            core.locate("p", [4], ["x"])
        core.commit("p", ["y"], warehouse=1, indexes=[0, 1], nbytes=20)  # the writer's retry is accepted
        assert core.ready_count("p", "c", ["x", "y"]) == 2


def _refused(args: list[str]) -> str:
    """Start `dockd serve ARGS`, which must refuse to start; its stderr."""
    proc = subprocess.run([sys.executable, "-m", "dockd", "serve", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    return proc.stderr


def test_big_puts_written_before_their_commit_survive_a_kill_bit_exact(data_dir):
    """Puts of WRITE_OFF_LOOP bytes or more have their body written and flushed by a worker thread
    before their commit, and only their header after it: they come back bit-exact after a SIGKILL,
    next to small puts written whole (every file in format 3), and a body damaged on disk refuses
    the start, naming the file."""
    big = [torch.randn(3, (WRITE_OFF_LOOP // 4 + 4096) // 3, generator=torch.Generator().manual_seed(k))
           for k in range(2)]
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        idx = [d.put({"y": b, "k": [k] * 3}, partition="big") for k, b in enumerate(big)]
        small = d.put({"y": torch.ones(2, 8), "k": [7, 7]}, partition="big")
        heads = {}
        for path in put_files(data_dir):
            with open(path, "rb") as f:
                heads[path] = int.from_bytes(f.read(12)[8:], "little")  # the format
        assert sorted(heads.values()) == [3, 3, 3], heads
        dk.kill_warehouse()
        dk.start_warehouse()
        got = d.get("c", ["y", "k"], 8, partition="big", timeout=20)
        assert sorted(got.indexes) == sorted(idx[0] + idx[1] + small)
        by = dict(zip(got.indexes, zip(got["y"], got["k"])))
        for k, b in enumerate(big):
            for row, i in enumerate(idx[k]):
                assert torch.equal(by[i][0], b[row]) and by[i][1] == k
        dk.kill_warehouse()
        two = max(heads, key=os.path.getsize)  # (a big one)
        with open(two, "r+b") as f:  # one byte of the body, near its end
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        err = _refused(["--join", dk.address, "--data-dir", data_dir, "--port", "0"])
        assert "checksum" in err and os.path.basename(two) in err, err[-2000:]


def test_a_data_dir_of_another_dock_is_refused(data_dir, tmp_path):
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        d.put({"x": torch.arange(3)}, partition="f")
        dk.kill_warehouse()
        other, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0"])
        try:
            err = _refused(["--join", f"127.0.0.1:{ready['port']}", "--data-dir", data_dir, "--port", "0",
                            "--join-timeout", "10"])
        finally:
            other.terminate()
            other.wait(20)
            assert other.stdout is not None
            other.stdout.close()
        assert "belongs to another dock" in err and f"--join {dk.address}" in err, err[-2000:]
        # a token the dir was not written with: another dock too
        token = tmp_path / "token"
        token.write_text("a" * 64)
        token.chmod(0o600)
        err = _refused(["--join", dk.address, "--data-dir", data_dir, "--token-file", str(token), "--port", "0",
                        "--join-timeout", "10"])
        assert "belongs to another dock" in err and "without a token" in err, err[-2000:]
        assert put_files(data_dir)  # refused: nothing touched


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_data_dir_of_another_user_is_refused(data_dir):
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        d.put({"x": torch.arange(3)}, partition="f")
        dk.kill_warehouse()
        os.chown(os.path.join(data_dir, "identity.json"), 4242, -1)
        err = _refused(["--join", dk.address, "--data-dir", data_dir, "--port", "0", "--join-timeout", "10"])
        assert "belongs to uid 4242" in err and "Run it as that user" in err, err[-2000:]


def test_without_a_data_dir_nothing_changes(data_dir):
    """The instance of a warehouse without a data dir never carries the durable mark, and a data
    dir is refused where it does not apply."""
    from dockd.config import NodeConfig
    from dockd.node.daemon import Node
    from dockd.terms import DURABLE

    for _ in range(64):
        assert not Node(NodeConfig(join="127.0.0.1:1")).instance & DURABLE
    with pytest.raises(dockd.DockValueError, match="--data-dir"):
        NodeConfig(controller=True, data_dir=data_dir)


def _flip(path: str, at: int) -> None:
    """Flip one byte of a file (offset `at`; negative: from its end)."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_SET if at >= 0 else os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_damaged_header_refuses_the_start_naming_the_file(data_dir):
    """One flipped byte in the partition name in a stored put's header is refused like a damaged body
    (before: the put was adopted under another partition, its samples unreadable, the controller told
    they were never acknowledged); the file is left as it was."""
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        d.put({"x": torch.arange(4)}, partition="step-0")
        dk.kill_warehouse()
        (path,) = put_files(data_dir)
        with open(path, "rb") as f:
            raw = f.read()
        _flip(path, raw.index(b'"step-0"') + 6)  # "step-0" -> "step-1"
        err = _refused(["--join", dk.address, "--data-dir", data_dir, "--port", "0"])
        assert os.path.basename(path) in err and "damaged" in err and "--drop-damaged-files" in err, err[-2000:]
        assert put_files(data_dir) == [path]


def test_drop_damaged_files_starts_without_them_and_reports_their_samples_lost(data_dir, tmp_path):
    """--drop-damaged-files moves a file that fails its check into DIR/damaged and starts: readers of its
    samples get DockDataLost naming them (not DockNotFound, not silence), the rest are read bit-exact, and
    the warehouse's log names the file and the samples. A file too damaged to say what it held makes every
    value the warehouse lacks lost, and its log line says so."""
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        bad = d.put({"x": torch.arange(4)}, partition="p")           # its body damaged: its samples are known
        good = d.put({"x": torch.arange(4, 8)}, partition="p")
        other = d.put({"x": torch.arange(8, 12)}, partition="q")     # replaced by garbage: nothing known
        dk.kill_warehouse()
        first, second = put_files(os.path.join(data_dir, "p-" + hashlib.sha1(b"p").hexdigest()))  # (in put order)
        _flip(first, -1)
        log = str(tmp_path / "wh.log")
        dk.start_warehouse("--drop-damaged-files", log=log)
        with pytest.raises(dockd.DockDataLost) as lost:
            d.read("p", bad, ["x"])
        assert sorted(lost.value.indexes) == bad, lost.value.indexes
        assert [int(v) for v in d.read("p", good, ["x"])["x"]] == [4, 5, 6, 7]
        moved = os.listdir(os.path.join(data_dir, "damaged"))
        assert len(moved) == 1 and moved[0].endswith(os.path.basename(first)) and os.path.exists(second)
        with open(log) as f:
            text = f.read()
        assert "moved damaged file" in text and first in text and f"indexes={bad}" in text, text[-3000:]

        dk.kill_warehouse()
        (q_file,) = put_files(os.path.join(data_dir, "p-" + hashlib.sha1(b"q").hexdigest()))
        with open(q_file, "r+b") as f:
            f.write(b"not a put at all")
        dk.start_warehouse("--drop-damaged-files", log=log)
        with pytest.raises(dockd.DockDataLost) as lost:
            d.read("q", other, ["x"])
        assert sorted(lost.value.indexes) == other
        assert [int(v) for v in d.read("p", good, ["x"])["x"]] == [4, 5, 6, 7]
        with open(log) as f:
            text = f.read()
        assert "too damaged to say which samples it held" in text and q_file in text, text[-3000:]


def test_a_fifo_named_like_a_stored_put_refuses_the_start_at_once(data_dir):
    """Only regular files are opened, without blocking: a fifo named `*.put` refuses the start naming it
    (before: the start hung in open() for ever); --drop-damaged-files moves it aside."""
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        idx = d.put({"x": torch.arange(5)}, partition="f")
        dk.kill_warehouse()
        (part,) = [n for n in os.listdir(data_dir) if n.startswith("p-")]
        fifo = os.path.join(data_dir, part, "00000000000000ff.put")
        os.mkfifo(fifo)
        err = _refused(["--join", dk.address, "--data-dir", data_dir, "--port", "0"])
        assert "fifo" in err and fifo in err, err[-2000:]
        dk.start_warehouse("--drop-damaged-files")
        assert not os.path.exists(fifo) and len(os.listdir(os.path.join(data_dir, "damaged"))) == 1
        assert [int(v) for v in d.read("f", idx, ["x"])["x"]] == [0, 1, 2, 3, 4]


def test_a_partition_dir_replaced_by_a_symlink_refuses_the_start(data_dir, tmp_path):
    """A partition dir moved to another disk and replaced by a symbolic link refuses the start, naming
    it and saying what to do (before: it was skipped without a word and its samples were unreadable);
    moved back, every sample is there."""
    with dock_with_data_dir(data_dir) as dk, dockd.connect(dk.address) as d:
        idx = d.put({"x": torch.arange(8)}, partition="s")
        dk.kill_warehouse()
        (part,) = [n for n in os.listdir(data_dir) if n.startswith("p-")]
        link, elsewhere = os.path.join(data_dir, part), str(tmp_path / "other-disk")
        shutil.move(link, elsewhere)
        os.symlink(elsewhere, link)
        err = _refused(["--join", dk.address, "--data-dir", data_dir, "--port", "0"])
        assert "symbolic link" in err and link in err and elsewhere in err, err[-2000:]
        os.unlink(link)
        shutil.move(elsewhere, link)
        dk.start_warehouse()
        assert [int(v) for v in d.read("s", idx, ["x"])["x"]] == list(range(8))


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_chaos_kill_under_a_stream_is_exactly_once(data_dir):
    """A producer and a consumer stream while the warehouse is SIGKILLed and restarted 3 times: every
    acknowledged sample reaches the consumer once, none twice, none reported lost by the dock."""
    with dock_with_data_dir(data_dir) as dk:
        acked: list[int] = []   # producer ids whose put was acknowledged
        seen: list[int] = []    # ids the consumer got
        errors: list[str] = []
        lost: list[str] = []
        stop = threading.Event()
        given_up = threading.Event()  # (the consumer stops even short of every sample: the asserts say so)

        def produce() -> None:
            with dockd.connect(dk.address, warehouse=dk.wh_address) as w:
                i = 0
                while not stop.is_set():
                    ids = list(range(i, i + 4))
                    x = [torch.full((BIG // 4,), float(k)) for k in ids]
                    try:
                        w.put({"id": ids, "x": x}, partition="s")
                    except dockd.DockError as e:  # (a re-sent put is applied once: the client retried already)
                        errors.append(f"put: {e!r}"[:200])
                        continue
                    acked.extend(ids)
                    i += 4
                    time.sleep(0.01)

        def consume() -> None:
            with dockd.connect(dk.address) as c:
                while not given_up.is_set() and (not stop.is_set() or len(seen) < len(acked)):
                    try:
                        b = c.get("c", ["id", "x"], 8, partition="s", timeout=1, allow_partial=True)
                    except dockd.DockTimeout as e:
                        if "keeps its data across restarts" in str(e):
                            # the warehouse is down: the client could not fetch, and gave the lease back
                            errors.append(f"get: {e!r}"[:200])
                        elif stop.is_set() and len(seen) >= len(acked):
                            return
                        continue
                    except dockd.DockDataLost as e:  # never: the samples of a durable warehouse wait for it
                        lost.append(repr(e))
                        continue
                    except dockd.DockConnectionError as e:
                        errors.append(f"get: {e!r}"[:200])
                        time.sleep(0.1)
                        continue
                    except dockd.DockNotFound:
                        time.sleep(0.05)
                        continue
                    for pos, k in enumerate(b["id"]):
                        assert torch.equal(b["x"][pos], torch.full((BIG // 4,), float(k))), k
                    seen.extend(b["id"])

        threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
        for t in threads:
            t.start()
        try:
            for k in range(3):
                n = len(acked)
                wait_until(lambda: len(acked) >= n + 40, 30, "the stream to run")  # noqa: B023
                time.sleep(0.05 * k)  # (somewhere else in the put/get cycle each time)
                dk.kill_warehouse()
                time.sleep(0.3)
                dk.start_warehouse()
            n = len(acked)
            wait_until(lambda: len(acked) >= n + 40, 30, "the stream to run after the restarts")
        finally:
            stop.set()
            threads[0].join(60)
            deadline = time.monotonic() + 60
            while len(seen) < len(acked) and time.monotonic() < deadline:
                time.sleep(0.1)
            given_up.set()
            threads[1].join(60)
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(all_threads=True)
            raise AssertionError("a producer or consumer call hung: every thread's stack is on stderr")
        print(f"acked={len(acked)} seen={len(seen)} transient errors={len(errors)}: {errors[:6]}")
        assert not lost, f"a get reported samples lost while their warehouse restarted: {lost[:3]}"
        dups = sorted({k for k in seen if seen.count(k) > 1})
        assert not dups, f"delivered twice: {dups[:20]}"
        missing = sorted(set(acked) - set(seen))
        assert not missing, f"acknowledged but never delivered: {missing[:20]}; errors: {errors[-5:]}"
        assert set(seen) <= set(acked) | set(range(max(acked, default=0) + 8)), "unknown ids"
        with dockd.connect(dk.address) as d:
            st = d.stats()
            assert next(iter(st["warehouses"].values()))["state"] == "joined"
            assert "lost" not in str(st["partitions"]["s"]), st["partitions"]["s"]
