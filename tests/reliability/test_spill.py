"""The spill tier (`dockd serve --spill-dir DIR`, issue 22 part 3): a warehouse whose memory
(--capacity) is full moves stored puts nobody reads to Arrow IPC files and reads them back
on a fetch. Puts of several times the capacity are all acknowledged and read back bit-exact;
the spill metrics add up; frees and clears delete the files; a full spill space ends in
DockFull naming both limits; a restart discards spill files (with --data-dir its files bring
every put back). Real `dockd serve` processes on loopback."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
import urllib.request

import pytest
import torch

import dockd
from dockd.local import spawn_node
from dockd.warehouse.spill import WRITE_OFF_LOOP
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
VALUES = 32768  # float32 values per sample: 128 KiB
PER_PUT = 4     # samples per put: 512 KiB, received into a shared-memory segment


@pytest.fixture
def spill_dir(tmp_path):
    path = str(tmp_path / "spill")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def node(*args: str):
    proc, ready = spawn_node(["--metrics-port", "0", "--port", "0", *args])
    try:
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)
        assert proc.stdout is not None
        proc.stdout.close()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def spill_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".arrow")) if os.path.isdir(path) else []


def samples(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(VALUES, generator=g) for _ in range(n)]


META: dict[tuple, dict] = {}


def put_all(d: dockd.Dock, partition: str, total: int, seed: int = 0) -> dict[int, torch.Tensor]:
    sent: dict[int, torch.Tensor] = {}
    for k in range(total // (PER_PUT * VALUES * 4)):
        vals = samples(PER_PUT, seed * 100_000 + k)
        meta = [{"k": k, "i": i} for i in range(PER_PUT)]
        for i, idx in enumerate(d.put({"x": vals, "m": meta}, partition=partition, timeout=20)):
            sent[idx] = vals[i]
            META[(partition, seed, idx)] = meta[i]
    return sent


def test_puts_of_four_times_the_capacity_spill_and_come_back_bit_exact(spill_dir):
    with node("--controller", "--capacity", "8MiB", "--spill-dir", spill_dir) as (_, ready), \
            dockd.connect(f"127.0.0.1:{ready['port']}") as d:
        port = ready["metrics_port"]
        sent = put_all(d, "p", 32 * MIB)  # 64 puts, 4x the capacity: none fails
        m = scrape(port)
        assert m["dockd_spill_out_bytes_total"] >= 24 * MIB, m
        assert m["dockd_warehouse_used_bytes"] <= 8 * MIB
        # nothing was read yet: all that went out is still out, each byte in one spill file
        assert m["dockd_spill_out_bytes_total"] == m["dockd_warehouse_spilled_bytes"] == m["dockd_spill_file_bytes"]
        assert len(spill_files(spill_dir)) >= 48
        st = d.stats(traffic=True)
        assert sum(w["bytes"] for w in st["warehouses"].values()) >= 32 * MIB  # the controller counts it all

        # a reader holds the tensors of a get (same host: mapped segments) while more puts spill
        held = d.get("a", ["x", "m"], 8, partition="p", timeout=20)
        more = put_all(d, "p", 8 * MIB, seed=1)
        for pos, k in enumerate(held.indexes):
            assert torch.equal(held["x"][pos], sent[k])
        sent.update(more)

        got: dict[int, torch.Tensor] = {k: held["x"][pos].clone() for pos, k in enumerate(held.indexes)}
        del held
        while len(got) < len(sent):
            b = d.get("a", ["x", "m"], min(16, len(sent) - len(got)), partition="p", timeout=20)
            for pos, k in enumerate(b.indexes):
                assert b["m"][pos] == META.get(("p", 0, k), META.get(("p", 1, k)))
                got[k] = b["x"][pos].clone()
        assert sorted(got) == sorted(sent)
        for k, v in sent.items():
            assert torch.equal(got[k], v), k

        m = scrape(port)
        back = m["dockd_spill_restored_bytes_total"] + m["dockd_spill_read_bytes_total"]
        assert back > 0, m
        # what went out is out still, or came back into memory, or was read where it lies
        assert m["dockd_spill_out_bytes_total"] >= m["dockd_warehouse_spilled_bytes"] + \
            m["dockd_spill_restored_bytes_total"]
        assert m["dockd_warehouse_spilled_bytes"] == m["dockd_spill_file_bytes"]

        d.clear("p")
        wait_until(lambda: not spill_files(spill_dir), 10, "the cleared partition's spill files to go")
        m = scrape(port)
        assert m["dockd_warehouse_spilled_bytes"] == 0 and m["dockd_spill_file_bytes"] == 0, m
        assert m["dockd_warehouse_used_bytes"] == 0, m


def test_big_puts_spill_in_the_background_and_come_back_bit_exact(spill_dir):
    """Puts of WRITE_OFF_LOOP bytes or more are written to their spill files by a worker thread and
    leave memory once a file is whole; the put waiting for the room is let in then. A partition
    cleared while its puts are being written leaves no file behind."""
    big = WRITE_OFF_LOOP // 4  # float32 values: one sample is one big put
    with node("--controller", "--capacity", "20MiB", "--spill-dir", spill_dir) as (_, ready), \
            dockd.connect(f"127.0.0.1:{ready['port']}") as d:
        for k in range(4):  # 16 MiB of another partition, the first to spill
            d.put({"x": torch.full((1, big), float(k))}, partition="r")
        sent: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []

        def producer() -> None:
            try:
                for k in range(12):  # 48 MiB more: each put spills one or two of those before it
                    x = torch.randn(1, big, generator=torch.Generator().manual_seed(k))
                    sent[d.put({"x": x}, partition="p", timeout=30)[0]] = x[0]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=producer)
        t.start()
        wait_until(lambda: sent, 30, "the first put that spills")
        d.clear("r")  # (its puts may be on their way to files)
        t.join(60)
        assert not errors, errors
        m = scrape(ready["metrics_port"])
        assert m["dockd_spill_out_bytes_total"] >= 16 * MIB, m
        assert m["dockd_warehouse_used_bytes"] <= 20 * MIB, m
        got = d.get("a", ["x"], len(sent), partition="p", timeout=30)
        assert sorted(got.indexes) == sorted(sent)
        for pos, k in enumerate(got.indexes):
            assert torch.equal(got["x"][pos], sent[k]), k
        del got
        d.clear("p")
        wait_until(lambda: not spill_files(spill_dir), 10, "every spill file to go")
        m = scrape(ready["metrics_port"])
        assert m["dockd_warehouse_spilled_bytes"] == 0 and m["dockd_spill_file_bytes"] == 0, m


def test_deleted_samples_take_their_spill_files_with_them(spill_dir):
    with node("--controller", "--capacity", "8MiB", "--spill-dir", spill_dir) as (_, ready), \
            dockd.connect(f"127.0.0.1:{ready['port']}") as d:
        sent = put_all(d, "p", 24 * MIB)
        files = len(spill_files(spill_dir))
        assert files >= 24
        spilled = scrape(ready["metrics_port"])["dockd_warehouse_spilled_bytes"]
        # delete the oldest (spilled) puts' samples without reading them: their files go
        d.delete("p", sorted(sent)[: 8 * PER_PUT])
        wait_until(lambda: len(spill_files(spill_dir)) <= files - 8, 10, "the deleted puts' spill files to go")
        m = scrape(ready["metrics_port"])
        assert m["dockd_warehouse_spilled_bytes"] <= spilled - 8 * PER_PUT * VALUES * 4
        assert m["dockd_spill_restored_bytes_total"] == 0
        # deleting the newest (in memory) makes room: a get of spilled samples then restores their put
        d.delete("p", sorted(sent)[-4 * PER_PUT:])
        got = d.get("a", ["x"], PER_PUT, partition="p", timeout=20)
        for pos, k in enumerate(got.indexes):
            assert torch.equal(got["x"][pos], sent[k])
        m = scrape(ready["metrics_port"])
        assert m["dockd_spill_restored_bytes_total"] >= PER_PUT * VALUES * 4, m
        assert m["dockd_warehouse_spilled_bytes"] == m["dockd_spill_file_bytes"]


def test_a_full_spill_space_ends_in_dock_full_naming_both_limits(spill_dir):
    with node("--controller", "--capacity", "8MiB", "--spill-dir", spill_dir, "--spill-capacity", "8MiB") \
            as (_, ready), dockd.connect(f"127.0.0.1:{ready['port']}") as d:
        vals = samples(PER_PUT, 0)
        with pytest.raises(dockd.DockFull) as e:
            for _ in range(64):
                d.put({"x": vals}, partition="p", timeout=1)
        msg = str(e.value)
        assert "--capacity" in msg and "--spill-capacity" in msg and spill_dir in msg, msg
        m = scrape(ready["metrics_port"])
        assert 0 < m["dockd_spill_file_bytes"] <= 8 * MIB, m
        d.clear("p")  # room again: puts go in
        wait_until(lambda: not spill_files(spill_dir), 10, "the spill files to go")
        d.put({"x": vals}, partition="p", timeout=10)


def test_a_restart_discards_the_spill_files(spill_dir):
    with node("--controller", "--no-warehouse") as (_, cready):
        ctl = f"127.0.0.1:{cready['port']}"
        args = ["--join", ctl, "--capacity", "8MiB", "--spill-dir", spill_dir, "--port", "0"]
        proc, ready = spawn_node(args)
        try:
            with dockd.connect(ctl) as d:
                put_all(d, "p", 16 * MIB)
                assert spill_files(spill_dir)
                with open(os.path.join(spill_dir, "other.txt"), "w") as f:  # not ours: left alone
                    f.write("x")
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                assert proc.stdout is not None
                proc.stdout.close()
                proc, ready = spawn_node(args)
                assert not spill_files(spill_dir)
                assert os.path.exists(os.path.join(spill_dir, "other.txt"))
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
            if proc.stdout is not None:
                proc.stdout.close()


def test_with_a_data_dir_spilling_drops_memory_and_a_restart_brings_all_back(spill_dir, tmp_path):
    data = str(tmp_path / "data")
    with node("--controller", "--no-warehouse", "--warehouse-grace", "30") as (_, cready):
        ctl = f"127.0.0.1:{cready['port']}"
        args = ["--join", ctl, "--capacity", "8MiB", "--spill-dir", spill_dir, "--data-dir", data,
                "--metrics-port", "0"]
        proc, ready = spawn_node(args + ["--port", "0"])
        port = ready["port"]
        try:
            with dockd.connect(ctl) as d:
                sent = put_all(d, "p", 20 * MIB)
                m = scrape(ready["metrics_port"])
                assert m["dockd_warehouse_spilled_bytes"] >= 12 * MIB, m
                assert not spill_files(spill_dir) and m["dockd_spill_file_bytes"] == 0  # the data dir holds them
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                assert proc.stdout is not None
                proc.stdout.close()
                proc, ready = spawn_node(args + ["--port", str(port)])  # more than --capacity comes back
                m = scrape(ready["metrics_port"])
                assert m["dockd_warehouse_spilled_bytes"] >= 12 * MIB, m
                got = {}
                deadline = time.monotonic() + 60
                while len(got) < len(sent) and time.monotonic() < deadline:
                    b = d.get("a", ["x"], min(16, len(sent) - len(got)), partition="p", timeout=20)
                    got.update((k, b["x"][pos].clone()) for pos, k in enumerate(b.indexes))
                assert sorted(got) == sorted(sent)
                assert all(torch.equal(got[k], v) for k, v in sent.items())
                d.clear("p")
                wait_until(lambda: scrape(ready["metrics_port"])["dockd_warehouse_spilled_bytes"] == 0, 10,
                           "the spilled bytes to go with the clear")
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
            if proc.stdout is not None:
                proc.stdout.close()
