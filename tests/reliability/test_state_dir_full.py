"""The controller's state dir when it is full or failing (issue 18, finding 5), a warehouse's data
dir when it is full, and lease deadlines across a restart whose wall clock jumped (finding 10).

A request whose journal record cannot be written whole applies nothing and fails with
DockStateFull; a short or failed write never leaves half a record for a later one to follow;
a controller restarted on a full state dir comes up with everything acknowledged; once there
is room again the dock works without a restart. The daemon tests put the state dir on a small
tmpfs (they need root to mount it, and skip without); the Journal tests inject the failures.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import dockd
import dockd.controller.journal as journal_mod
from dockd.controller.journal import Journal
from dockd.errors import DockLeaseError, DockStateFull
from dockd.local import spawn_node
from tests.conftest import wait_until
from tests.integration.test_cluster import Procs, free_port

# A test that patches one of the journal's own functions: a compiled journal calls them directly, unpatched.
PATCHES_JOURNAL = pytest.mark.skipif(not (journal_mod.__file__ or "").endswith(".py"),
                                     reason="patches the journal's own _write_all, which a compiled journal calls directly")

pytestmark = pytest.mark.timeout(240)


# -- the Journal alone, with injected failures ----------------------------------------------------
def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _new_journal(path) -> tuple[Journal, object]:
    j = Journal(path)
    core, _ = j.load(lease_timeout=60, now=0.0)
    return j, core


def _put(j: Journal, core, put_id: int, n: int = 2) -> list[int]:
    """A put as the service makes it: its record first, then the controller."""
    j.room()
    j.commit("p", ["x"], 1, None, n, 1, 10 * n, put_id)
    return core.commit("p", ["x"], warehouse=1, new_count=n, nbytes=10 * n, put_id=put_id).tolist()


def test_a_record_whose_request_is_then_refused_is_cut_off(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    assert _put(j, core, 1) == [0, 1]
    with pytest.raises(ValueError), j.ahead():
        j.commit("p", ["x"], 1, None, 2, 1, 20, 2)
        raise ValueError("refused by its checks")
    assert _put(j, core, 3) == [2, 3]
    monkeypatch.setattr(os, "ftruncate", _enospc)
    with pytest.raises(ValueError), j.ahead():  # cannot be cut off: no record is taken until a snapshot
        j.commit("p", ["x"], 1, None, 2, 1, 20, 4)
        raise ValueError("refused by its checks")
    assert j.broken is not None
    monkeypatch.undo()
    assert j.compact(core, {}, now=0.0)  # the snapshot a broken journal waits for (the service retries it)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.stats()[0]["samples"] == 4
    j2, core2 = _new_journal(tmp_path / "again")
    with j2.ahead():
        _put(j2, core2, 1)
    j2.close()
    assert Journal(tmp_path / "again").load(lease_timeout=60, now=0.0)[0].stats()[0]["samples"] == 2


def test_a_short_write_is_cut_back_and_the_request_is_refused(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    assert _put(j, core, 1) == [0, 1]
    real = os.write

    def short(fd, data):  # half the record fits, then the disk is full
        monkeypatch.setattr(os, "write", _enospc)
        return real(fd, bytes(data[: len(data) // 2]))

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(DockStateFull, match=r"state dir .* is full \(\d+ bytes free\): this request was not applied"):
        _put(j, core, 2)
    monkeypatch.setattr(os, "write", real)
    assert core.partitions["p"].size == 2  # the refused put is nowhere
    assert _put(j, core, 3) == [2, 3]  # acknowledged after the failure: it must not follow half a record
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.partitions["p"].size == 4
    assert back.put_keys[1].keys() == {1, 3}


def test_a_full_disk_is_refused_before_anything_is_decided(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1)
    monkeypatch.setattr(journal_mod, "_reserve_space", _enospc)  # the disk is full ...
    j.reserved = j.size  # ... and the space reserved ahead is used up
    with pytest.raises(DockStateFull, match="is full"):
        j.room()
    # a confirm or a release may still use what is left of the margin; a record that does not fit is refused whole
    with pytest.raises(DockStateFull):
        j.confirm([1])
    monkeypatch.undo()
    j.room()  # space is back: the next request goes through, no restart
    _put(j, core, 2)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.partitions["p"].size == 4


@PATCHES_JOURNAL
def test_a_decision_that_cannot_be_recorded_stops_the_journal_until_a_snapshot(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1)
    res = core.acquire("p", "c", ["x"], 2, now=0.0)
    j.grant(core.leases[res.lease], 60.0)
    monkeypatch.setattr(journal_mod, "_write_all", _enospc)
    monkeypatch.setattr(os, "ftruncate", _enospc)  # the half record cannot even be cut off
    core.expire_leases(1e9)
    assert j.release(res.lease, applied=True) is False  # (the expiry happened; its record did not)
    assert j.broken is not None
    with pytest.raises(DockStateFull, match="cannot record its decisions"):
        j.room()
    monkeypatch.undo()
    assert j.compaction_due(now=0.0)
    assert j.compact(core, {}, now=0.0)  # the snapshot has the expiry
    j.room()
    _put(j, core, 2)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert not back.leases and back.partitions["p"].size == 4


def test_a_restart_with_no_room_for_a_snapshot_appends_to_the_journal_it_read(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1)
    j.close()
    log = next(tmp_path.glob("journal-*.log"))
    log.write_bytes(log.read_bytes() + b"\x10\x00\x00\x00torn")  # killed mid-write
    monkeypatch.setattr(journal_mod, "_write_all", _enospc)  # no snapshot can be written
    j2 = Journal(tmp_path)
    core2, _ = j2.load(lease_timeout=60, now=0.0)
    assert core2.partitions["p"].size == 2
    monkeypatch.undo()
    assert _put(j2, core2, 2) == [2, 3]  # after the cut-off torn tail, readable
    j2.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.partitions["p"].size == 4


def test_a_request_recorded_ahead_that_was_refused_replays_to_nothing(tmp_path):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1)
    j.seal("p")
    core.seal("p")
    with pytest.raises(dockd.DockValueError):
        _put(j, core, 2)  # refused by the controller after its record was written
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.partitions["p"].size == 2 and back.partitions["p"].sealed


def _get(j: Journal, core, n: int = 1):
    """A get as the service makes it: decided, then its grant recorded."""
    j.room()
    res = core.acquire("p", "c", ["x"], n, now=0.0)
    j.grant(core.leases[res.lease], 60.0)
    return res.lease


def test_a_gets_confirm_goes_to_the_file_with_its_grant_in_one_write(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1, n=4)
    first = _get(j, core)
    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(len(data)) or real(fd, data))
    j.confirm([first], hold=True)  # the next get carries the confirm of the last one
    core.confirm(first)
    assert not writes
    second = _get(j, core)
    assert len(writes) == 1  # confirm and grant together
    j.confirm([second], hold=True)
    core.confirm(second)
    j.flush()  # a get that waits, or takes nothing new: the confirm goes alone, before its answer
    assert len(writes) == 2
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert not back.leases and back.partitions["p"].consumers["c"].taken == 2


@PATCHES_JOURNAL
def test_a_held_confirm_that_cannot_be_written_stops_the_journal_and_its_get_is_refused(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1, n=4)
    first = _get(j, core)
    j.confirm([first], hold=True)
    core.confirm(first)  # applied at once: the service answers only after the write
    monkeypatch.setattr(journal_mod, "_write_all", _enospc)
    with pytest.raises(DockStateFull):
        _get(j, core)
    assert j.broken is not None  # the confirm was applied but not recorded: no record is taken until a snapshot
    monkeypatch.undo()
    assert j.compact(core, {}, now=0.0)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=0.0)
    assert back.partitions["p"].consumers["c"].taken == 1  # the snapshot has the confirm


def test_a_confirm_held_on_a_full_disk_is_refused_before_it_is_applied(tmp_path, monkeypatch):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1, n=4)
    first = _get(j, core)
    monkeypatch.setattr(journal_mod, "_reserve_space", _enospc)
    j.reserved = j.size
    with pytest.raises(DockStateFull, match="is full"):
        j.confirm([first], hold=True)
    assert j.broken is None and not j._held


def test_restored_leases_get_the_seconds_they_had_left_on_the_new_clock(tmp_path):
    j, core = _new_journal(tmp_path)
    _put(j, core, 1, n=4)
    res = core.acquire("p", "c", ["x"], 2, now=0.0)
    j.grant(core.leases[res.lease], 30.0)
    j.close()
    back, _ = Journal(tmp_path).load(lease_timeout=60, now=5000.0)  # another process, another clock
    assert back.leases[res.lease].deadline == 5030.0
    again, _ = Journal(tmp_path).load(lease_timeout=60, now=70.0)  # from the snapshot the last load wrote
    assert again.leases[res.lease].deadline == 100.0


# -- daemons with the state dir on a small tmpfs --------------------------------------------------
# (small_fs: a 1 MiB tmpfs, tests/reliability/conftest.py)


class _Dock(Procs):
    """A controller without data (state dir given) and one warehouse; stopped at the end."""

    def __init__(self, state: str, *extra: str, env: dict | None = None) -> None:
        super().__init__()
        self.port, self.state, self.extra = free_port(), state, extra
        self.address = f"127.0.0.1:{self.port}"
        self.ctl = self.start_controller(env=env)
        self.procs.append(spawn_node(["--port", "0", "--join", self.address])[0])

    def start_controller(self, env: dict | None = None) -> subprocess.Popen:
        proc, _ = spawn_node(["--controller", "--no-warehouse", "--port", str(self.port), "--lease-timeout", "60",
                              "--state-dir", self.state, *self.extra], env=env)
        self.procs.append(proc)
        self.ctl = proc
        return proc

    def kill_controller(self) -> None:
        self.ctl.send_signal(signal.SIGKILL)
        self.ctl.wait()


@pytest.fixture
def docks():
    made: list[_Dock] = []
    yield lambda *a, **k: made.append(_Dock(*a, **k)) or made[-1]
    for d in made:
        d.close()


def _fill(mnt) -> str:
    """Take every free byte of the tmpfs with a filler file; returns its path."""
    path = os.path.join(mnt, f"filler-{time.monotonic_ns()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096):
            try:
                while True:
                    os.write(fd, b"\1" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def _put_until_refused(d, partition: str, values: dict[int, int], start: int, limit: int = 20000) -> DockStateFull:
    """One-sample puts until the controller refuses one; acknowledged ones go into `values`."""
    for k in range(start, start + limit):
        try:
            idx = d.put({"x": torch.tensor([k])}, partition=partition)
        except DockStateFull as e:
            return e
        values[idx[0]] = k
    raise AssertionError(f"{limit} puts went through: the state dir never filled up")


def _read_all(d, consumer: str, partition: str, n: int) -> dict[int, int]:
    b = d.get(consumer, ["x"], n, partition=partition, timeout=30)
    return dict(zip(b.indexes, (int(t) for t in b["x"])))


def test_a_full_state_dir_refuses_requests_whole_and_the_dock_resumes_by_itself(small_fs, docks):
    dock = docks(str(small_fs / "state"))
    values: dict[int, int] = {}
    with dockd.connect(dock.address) as d:
        values[d.put({"x": torch.tensor([-1])}, partition="p")[0]] = -1
        filler = _fill(small_fs)
        err = _put_until_refused(d, "p", values, 0)
        assert "state dir" in str(err) and "is full" in str(err) and "not applied" in str(err), err
        for k in range(50):  # every later put fails the same way, and none is counted
            with pytest.raises(DockStateFull):
                d.put({"x": torch.tensor([10**6 + k])}, partition="p")
        assert d.stats()["partitions"]["p"]["samples"] == len(values)
        for _ in range(20):  # gets that cannot record their lease take nothing
            with pytest.raises(DockStateFull):
                d.get("c", ["x"], 5, partition="p", timeout=1)
        cons = d.stats()["partitions"]["p"]["consumers"].get("c", {"leased": 0, "taken": 0})
        assert cons["leased"] == 0 and cons["taken"] == 0

        os.unlink(filler)  # room again: no restart
        values[d.put({"x": torch.tensor([-2])}, partition="p")[0]] = -2
        assert _read_all(d, "c", "p", len(values)) == values


def test_acknowledged_puts_survive_a_sigkill_and_a_restart_on_a_full_state_dir(small_fs, docks):
    dock = docks(str(small_fs / "state"))
    values: dict[int, int] = {}
    with dockd.connect(dock.address, reconnect_timeout=60) as d:
        filler = _fill(small_fs)
        _put_until_refused(d, "p", values, 0)
        dock.kill_controller()
        fillers = [filler, _fill(small_fs)]  # whatever the dead controller had reserved is taken too
        dock.start_controller()  # on a full disk: it comes up from its journal
        assert d.stats()["partitions"]["p"]["samples"] == len(values)
        fillers.append(_fill(small_fs))
        _put_until_refused(d, "p", values, 10**5)  # and refuses cleanly when full again
        for f in fillers:
            os.unlink(f)
        values[d.put({"x": torch.tensor([-1])}, partition="p")[0]] = -1
        assert _read_all(d, "c", "p", len(values)) == values  # every acknowledged put, with its value
        deadline = time.monotonic() + 30
        while d.stats()["partitions"]["p"]["consumers"]["c"]["taken"] < len(values):  # (confirms go out batched)
            assert time.monotonic() < deadline, "the get's confirm never reached the controller"
            time.sleep(0.1)
        dock.kill_controller()
        dock.start_controller()
        assert d.stats()["partitions"]["p"]["consumers"]["c"]["taken"] == len(values)


# -- lease deadlines across a restart whose wall clock jumped ---------------------------------------
# The controller's wall clock moved by DOCKD_TEST_WALL_SHIFT seconds (its monotonic clock did not):
# the controller's modules see the shifted time (grpc's threads would not start under a patched
# time.time, so the patch stays inside dockd.controller).
_SITECUSTOMIZE = """\
import os
_shift = float(os.environ.get("DOCKD_TEST_WALL_SHIFT", "0"))
if _shift:
    import time, types
    import dockd.controller.journal, dockd.controller.membership, dockd.controller.service
    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.time = lambda: time.time() + _shift
    clock.time_ns = lambda: time.time_ns() + int(_shift * 1e9)
    for m in (dockd.controller.journal, dockd.controller.membership, dockd.controller.service):
        if hasattr(m, "time"):
            m.time = clock
"""


@pytest.mark.slow  # (CI runs it: make test-slow)
@pytest.mark.parametrize("shift", [3600.0, -3600.0], ids=["clock+1h", "clock-1h"])
def test_a_wall_clock_jump_across_a_restart_neither_expires_a_live_lease_nor_strands_a_dead_one(tmp_path, docks,
                                                                                                shift):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    dock = docks(str(tmp_path / "state"))
    with dockd.connect(dock.address, reconnect_timeout=60) as d:
        d.put({"x": torch.arange(4)}, partition="p")  # (each consumer leases all four)
        live = d.acquire("live", ["x"], 4, partition="p", timeout=10)  # 60 s: its consumer is still working
        dead = d.acquire("dead", ["x"], 4, partition="p", timeout=10, lease_timeout=3)  # never confirmed
        dock.kill_controller()
        env = dict(os.environ, DOCKD_TEST_WALL_SHIFT=str(shift),
                   PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), *sys.path]))
        dock.start_controller(env=env)
        t0 = time.monotonic()
        cons = d.stats()["partitions"]["p"]["consumers"]
        assert cons["live"]["leased"] == 4, cons  # not expired by a clock that jumped ahead
        try:
            d.confirm(live)
        except DockLeaseError as e:
            raise AssertionError(f"a live lease expired across the restart: {e}") from None
        back = d.get("dead", ["x"], 4, partition="p", timeout=20)  # its samples come back within its 3 s
        assert sorted(back.indexes) == sorted(dead.indexes) and time.monotonic() - t0 < 15


def test_a_full_data_dir_fails_puts_before_their_commit_and_strands_no_sample(small_fs, partition):
    """A warehouse with a data dir on a full disk refuses a put before its commit (the room for its file
    is taken first): the controller never records values that were not stored, so no get meets a
    sample that is not there, and every acknowledged sample is delivered. Before, the put failed after
    its commit, and the first get to reach such a sample failed with DockNotFound, again and again
    (FIFO hands out the same batch), stranding the acknowledged samples around it."""
    ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0"])
    address = f"127.0.0.1:{ready['port']}"
    wh, _ = spawn_node(["--port", "0", "--join", address, "--data-dir", str(small_fs / "wh"), "--capacity", "64MiB"])
    try:
        with dockd.connect(address) as d:
            acked: dict[int, float] = {}
            refused = 0
            for k in range(40):  # 64 KiB each: the 1 MiB disk holds about 15
                try:
                    idx = d.put({"x": torch.full((1, 16 << 10), float(k))}, partition=partition)
                    acked[idx[0]] = float(k)
                except DockStateFull as e:
                    assert "data-dir" in str(e) and "Free room there" in str(e), e
                    refused += 1
            assert acked and refused >= 10, (len(acked), refused)
            assert d.stats()["partitions"][partition]["samples"] == len(acked)
            b = d.get("c", ["x"], len(acked), partition=partition, timeout=10)
            assert {i: float(x[0]) for i, x in zip(b.indexes, b["x"])} == acked
            d.clear(partition)  # room again: puts go through without a restart

            def put_goes_through() -> bool:
                try:
                    return d.put({"x": torch.zeros(1, 16 << 10)}, partition=partition + "-2") == [0]
                except DockStateFull:  # (the frees reach the warehouse a moment after the clear)
                    return False

            wait_until(put_goes_through, 10, "a put once the data dir has room")
    finally:
        for p in (wh, ctrl):
            p.terminate()
            p.wait(20)
            p.stdout.close()


def test_requests_refused_after_their_record_was_written_stay_refused_after_a_restart(tmp_path):
    """A commit (or a partition operation) is journaled before it is applied; one that its checks then
    refuse (DockFull past --max-samples) was reported failed but stayed in the journal, and a restart,
    which replays under the default bounds, applied it: the failed put's samples came back as written."""
    from dockd.errors import DockFull
    from tests.conftest import serving

    args = ["--controller", "--port", "0", "--capacity", "64MiB", "--state-dir", str(tmp_path / "state"),
            "--max-samples", "100"]
    with serving(*args) as (address, proc):
        with dockd.connect(address) as d:
            d.put({"x": torch.arange(100)}, partition="p")
            with pytest.raises(DockFull, match="max-samples"):
                d.put({"x": torch.arange(3)}, partition="p")
            with pytest.raises(DockFull, match="max-samples"):
                d.reserve("p", 4)
            assert d.stats()["partitions"]["p"]["samples"] == 100
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with serving(*args) as (address, proc), dockd.connect(address) as d:
        assert d.stats()["partitions"]["p"]["samples"] == 100
        d.clear("p")
        d.put({"x": torch.arange(100)}, partition="q")  # the bound is whole again
