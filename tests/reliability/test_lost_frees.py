"""Finding 10 of the hardening review: a free the controller sends a warehouse can fail (its
connection closes at that moment, or the warehouse is away). What it should have freed must not
stay stored: the warehouse frees it once it is back. A warehouse joined through a proxy that cuts
the controller's connection exactly at a free, and holds the warehouse's reconnection until the
test lets it through. Real `dockd serve` processes on loopback."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading

import pytest
import torch

import dockd
from dockd.local import spawn_node
from dockd.net import wire
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)


class CutAtFree:
    """A TCP proxy in front of the controller: cut() makes it close the connection that carries the
    next free request (before it reaches the warehouse), away() closes the connections now; either
    holds every connection made after that until release()."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.armed = threading.Event()
        self.cutting = threading.Event()  # a free was cut: new connections wait for release
        self.released = threading.Event()
        self.cut_free: object = None      # the FreeRequest cut
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.armed.set()

    def away(self) -> None:
        self.cutting.set()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        self.server.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            self.socks.append(down)
            threading.Thread(target=self._open, args=(down,), daemon=True).start()

    def _open(self, down: socket.socket) -> None:
        if self.cutting.is_set():
            self.released.wait()
        try:
            up = socket.create_connection(self.target)
        except OSError:
            down.close()
            return
        self.socks.append(up)
        threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_controller: bool) -> None:
        buf = b""
        try:
            while data := src.recv(1 << 20):
                if not from_controller:
                    dst.sendall(data)
                    continue
                buf += data
                while len(buf) >= wire.PREFIX.size:
                    _, hlen, blen = wire.PREFIX.unpack_from(buf, 0)
                    end = wire.PREFIX.size + hlen + blen
                    if len(buf) < end:
                        break
                    frame = wire.parse_header(buf[wire.PREFIX.size : wire.PREFIX.size + hlen])
                    if frame.WhichOneof("kind") == "free" and not frame.reply and self.armed.is_set():
                        self.armed.clear()
                        self.cut_free = frame.free
                        self.cutting.set()
                        return  # (finally: both ends closed, the free never delivered)
                    dst.sendall(buf[:end])
                    buf = buf[end:]
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


class Dock:
    """A controller without a warehouse, and one warehouse that joins it through a CutAtFree proxy
    (both hold the daemon token: the warehouse cannot read the controller's own secret by port)."""

    def __init__(self, tmp_path) -> None:
        self.procs = []
        tokens = {}
        for name in ("token", "daemon"):
            path = tmp_path / f"{name}.token"
            path.write_text(secrets.token_hex(32))
            path.chmod(0o600)
            tokens[name] = str(path)
        self.token = (tmp_path / "token.token").read_text()
        auth = ["--token-file", tokens["token"], "--daemon-token-file", tokens["daemon"]]
        ctrl, ready = spawn_node(["--controller", "--no-warehouse", "--port", "0", "--warehouse-grace", "60", *auth])
        self.procs.append(ctrl)
        self.address = f"127.0.0.1:{ready['port']}"
        self.proxy = CutAtFree(("127.0.0.1", ready["port"]))
        wh, _ = spawn_node(["--join", f"127.0.0.1:{self.proxy.port}", "--port", "0", "--capacity", "256MiB", *auth])
        self.procs.append(wh)

    def close(self) -> None:
        self.proxy.close()
        for p in reversed(self.procs):
            p.terminate()
            p.wait(20)
            p.stdout.close()


@pytest.fixture
def dock(tmp_path):
    d = Dock(tmp_path)
    try:
        yield d
    finally:
        d.close()


def warehouse(d: dockd.Dock) -> dict:
    (w,) = d.stats(traffic=True)["warehouses"].values()
    return w


@pytest.mark.parametrize("how", ["cut at the free", "away"])
def test_a_clear_the_warehouse_missed_is_applied_before_the_partition_is_written_again(dock, how):
    """The clear's free never reaches the warehouse (cut on its way, or the warehouse is away), and the
    partition is made again under the same name before the warehouse is back: its old values must go
    (they hold the new samples' indexes: before, the new put was acknowledged but not filed, and a get
    returned the cleared values), the new ones stay."""
    with dockd.connect(dock.address, token=dock.token) as d:
        old = torch.arange(8 * 1000, dtype=torch.float32).view(8, 1000)
        assert d.put({"x": old}, partition="r") == list(range(8))
        one_put = warehouse(d)["metadata_bytes"]  # (the warehouse's own bookkeeping of what it stores)
        if how == "away":
            dock.proxy.away()
            wait_until(lambda: warehouse(d)["state"] != "joined", 10, "the controller to see the warehouse away")
            d.clear("r")
        else:
            dock.proxy.cut()
            d.clear("r")
            assert dock.proxy.cut_free is not None and not dock.proxy.cut_free.indexes  # (the clear's, cut)
            wait_until(lambda: warehouse(d)["state"] != "joined", 10, "the controller to see the warehouse away")
        d.create_partition("r")  # the same name again, while the warehouse is away
        dock.proxy.release()
        wait_until(lambda: warehouse(d)["state"] == "joined", 30, "the warehouse to rejoin")
        assert warehouse(d)["bytes"] == 0  # nothing of the old partition is counted
        new = -torch.arange(8 * 1000, dtype=torch.float32).view(8, 1000)
        assert d.put({"x": new}, partition="r", timeout=10) == list(range(8))
        got = d.get("c", ["x"], 8, partition="r", timeout=10)
        assert torch.equal(torch.stack([got["x"][got.indexes.index(k)] for k in range(8)]), new)
        w = warehouse(d)
        assert w["bytes"] == new.numel() * 4 and w["metadata_bytes"] == one_put, w  # the new put only


def test_deleted_samples_whose_free_was_cut_are_freed_once_the_warehouse_is_back(dock):
    with dockd.connect(dock.address, token=dock.token) as d:
        d.put({"x": torch.zeros(8, 1000)}, partition="d")
        d.put({"x": torch.ones(8, 1000)}, partition="d")  # (another put: the first one goes whole)
        dock.proxy.cut()
        d.delete("d", list(range(8)))
        wait_until(lambda: dock.proxy.cut_free is not None, 10, "the delete's free to be cut")
        assert list(dock.proxy.cut_free.indexes) == list(range(8))
        wait_until(lambda: warehouse(d)["state"] != "joined", 10, "the controller to see the warehouse away")
        dock.proxy.release()
        wait_until(lambda: warehouse(d)["state"] == "joined", 30, "the warehouse to rejoin")
        wait_until(lambda: warehouse(d)["bytes"] == 8 * 1000 * 4, 10, "the deleted put's bytes to be freed")
        got = d.get("c", ["x"], 8, partition="d", timeout=10)
        assert sorted(got.indexes) == list(range(8, 16)) and all(bool((x == 1).all()) for x in got["x"])
