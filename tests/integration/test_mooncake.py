"""The Mooncake Transfer Engine transport: real daemons on loopback, the engine's TCP protocol.

Needs the engine's package (`pip install '.[mooncake]'`, and libibverbs1: `make mooncake`, which
`make test` runs); without it the module is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine is not installed or does not load "
                                              "(make mooncake: pip install '.[mooncake]' plus libibverbs1)")

import dockd  # noqa: E402
from dockd.net import mooncake, mooncake_engine  # noqa: E402
from dockd.net.mooncake import EngineUnavailable  # noqa: E402
from tests.conftest import serving, wait_child  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _counter(text: str, name: str, transport: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'dockd_{name}{{transport="{transport}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def mooncake_dock():
    """A controller and a second warehouse, both serving remote readers with the engine."""
    from dockd.local import spawn_node

    procs = []
    try:
        ctl, ready0 = spawn_node(["--controller", "--port", "0", "--capacity", "1GiB", "--transport", "mooncake",
                                  "--metrics-port", "0"])
        procs.append(ctl)
        address = f"127.0.0.1:{ready0['port']}"
        wh, ready1 = spawn_node(["--join", address, "--port", "0", "--capacity", "1GiB", "--transport", "mooncake",
                                 "--metrics-port", "0"])
        procs.append(wh)
        yield address, ready0, ready1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
            p.stdout.close()


def test_put_get_bit_exact_across_two_warehouses(mooncake_dock, partition, monkeypatch):
    """Columns on two warehouses read with the engine: large runs pulled from registered segments,
    small ones in the frame body; every value bit-exact; the warehouse counts the bytes as mooncake."""
    address, _, ready1 = mooncake_dock
    monkeypatch.setenv("DOCKD_TRANSPORT", "mooncake")
    before = _counter(_metrics(ready1["metrics_port"]), "get_bytes_total", "mooncake")
    g = torch.Generator().manual_seed(7)
    big = [torch.randn(1 << 16, generator=g) for _ in range(8)]               # 256 KiB each: engine reads
    ragged = [torch.randint(-1000, 1000, (int(n),), generator=g).to(torch.bfloat16)
              for n in torch.randint(1 << 15, 1 << 17, (8,), generator=g)]    # lengths vary
    tiny = [torch.arange(3) + i for i in range(8)]                            # in the body
    meta = [{"i": i} for i in range(8)]
    with dockd.connect(address, warehouse=1) as w1, dockd.connect(address, warehouse=0) as w0:
        idx = w1.put({"big": big, "ragged": ragged, "tiny": tiny, "meta": meta}, partition=partition)
        spread = [torch.full((1 << 15,), float(i)) for i in range(8)]        # half on each warehouse
        w1.put({"spread": spread[::2]}, partition=partition, indexes=idx[::2])
        w0.put({"spread": spread[1::2]}, partition=partition, indexes=idx[1::2])
        reads = mooncake_engine.stats().get("reads", 0)
        b = w0.get("c", ["big", "ragged", "tiny", "meta", "spread"], 8, partition=partition, timeout=30)
        assert b.indexes == idx
        for got, want in zip(b["big"], big):
            assert torch.equal(got, want)
        for got, want in zip(b["ragged"], ragged):
            assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
        for got, want in zip(b["tiny"], tiny):
            assert torch.equal(got, want)
        assert b["meta"] == meta
        for got, want in zip(b["spread"], spread):
            assert torch.equal(got, want)
        s = mooncake_engine.stats()
        assert s["reads"] > reads and s["protocol"] == "tcp"
        assert w0.stats()["warehouses"][1]["transport"] == "mooncake"
        del b
    after = _counter(_metrics(ready1["metrics_port"]), "get_bytes_total", "mooncake")
    assert after - before >= sum(t.numel() * 4 for t in big)


def test_receive_buffers_are_registered_once_and_reused(mooncake_dock, partition, monkeypatch):
    """Repeated gets of the same size reuse the pooled receive buffer: no registration per call."""
    address, _, _ = mooncake_dock
    monkeypatch.setenv("DOCKD_TRANSPORT", "mooncake")
    with dockd.connect(address, warehouse=1) as w1, dockd.connect(address, warehouse=0) as w0:
        for _ in range(6):
            w1.put({"x": [torch.ones(1 << 18) for _ in range(4)]}, partition=partition)  # 1 MiB each
        b = w0.get("c", ["x"], 4, partition=partition, timeout=30)
        assert all(torch.equal(t, torch.ones(1 << 18)) for t in b["x"])
        del b  # (the buffer goes back to the pool)
        registered = mooncake_engine.stats()["receive_buffers_registered"]
        for _ in range(5):
            b = w0.get("c", ["x"], 4, partition=partition, timeout=30)
            assert all(torch.equal(t, torch.ones(1 << 18)) for t in b["x"])
            del b
        assert mooncake_engine.stats()["receive_buffers_registered"] == registered


def test_daemon_and_client_name_the_transport(mooncake_dock, partition):
    """The ready line, `dockd status --json` (what each warehouse serves with) and dock.stats() (how this
    client reads) name the transport; dockd.connect(transport=...) asks for it."""
    address, ready0, ready1 = mooncake_dock
    assert ready0["transport"] == ready1["transport"] == "mooncake"
    with dockd.connect(address, warehouse=0, transport="mooncake") as d:
        d.put({"x": [torch.zeros(1 << 17)]}, partition=partition)
        with dockd.connect(address, warehouse=1, transport="mooncake") as r:
            assert torch.equal(r.get("c", ["x"], 1, partition=partition, timeout=30)["x"][0], torch.zeros(1 << 17))
            s = r.stats(traffic=True)
            assert s["transport"] == "mooncake"
            assert s["warehouses"][0]["transport"] == "mooncake" and s["warehouses"][0]["serves"] == "mooncake"
    out = subprocess.run([sys.executable, "-m", "dockd", "status", address, "--json", "--interval", "0"],
                         capture_output=True, text=True, timeout=60, check=True)
    snap = json.loads(out.stdout.splitlines()[0])
    assert {w["serves"] for w in snap["warehouses"].values()} == {"mooncake"}


@pytest.fixture
def broken_engine(tmp_path):
    """PYTHONPATH under which `mooncake.engine` fails to load the way it does without libibverbs."""
    pkg = tmp_path / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or directory')\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def test_required_mode_refuses_to_start_naming_what_is_missing(broken_engine):
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--controller", "--port", "0",
                          "--transport", "mooncake"], capture_output=True, text=True, timeout=60, env=broken_engine)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "--transport mooncake" in out.stderr and "libibverbs" in out.stderr, out.stderr[-3000:]
    assert '"ready"' not in out.stdout


def test_auto_mode_starts_without_the_engine_and_says_so(broken_engine):
    from dockd.local import spawn_node

    proc, ready = spawn_node(["--controller", "--port", "0", "--transport", "auto"], env=broken_engine)
    try:
        assert ready["transport"] == "socket"
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stdout.close()


def test_required_client_refuses_a_warehouse_without_engine(partition, monkeypatch):
    """transport='mooncake' never falls back quietly: a warehouse serving over the socket is an error
    naming it; under 'auto' the same read works over TCP, and stats say so and why."""
    # (values of the controller's own warehouse may come inline with the acquire: read from a second one)
    with serving("--controller", "--port", "0", "--capacity", "256MiB") as (address, _), \
            serving("--join", address, "--port", "0", "--capacity", "256MiB", "--transport", "socket", "--no-shm"):
        with dockd.connect(address, warehouse=1) as w:
            w.put({"x": [torch.ones(1 << 17) for _ in range(2)]}, partition=partition)
        monkeypatch.setenv("DOCKD_TRANSPORT", "mooncake")
        with dockd.connect(address, warehouse=0) as r, \
                pytest.raises(EngineUnavailable, match="warehouse 1 at .*serves remote readers over the socket"):
            r.get("c", ["x"], 2, partition=partition, timeout=30)
        monkeypatch.setenv("DOCKD_TRANSPORT", "auto")
        # (auto uses the engine for other hosts only: this one stands in for another host)
        monkeypatch.setattr(mooncake, "is_local", lambda host: False)
        with dockd.connect(address, warehouse=0) as r:
            b = r.get("c2", ["x"], 2, partition=partition, timeout=30)
            assert all(torch.equal(t, torch.ones(1 << 17)) for t in b["x"])
            w1 = r.stats()["warehouses"][1]
            assert w1["transport"] == "tcp" and "over the socket" in w1["transport_note"]


def test_required_client_whose_engine_cannot_load_says_why(mooncake_dock, partition, broken_engine):
    address, _, _ = mooncake_dock
    with dockd.connect(address, warehouse=1) as w:
        w.put({"x": [torch.ones(1 << 17)]}, partition=partition)
    code = textwrap.dedent("""
        import sys, dockd
        from dockd.net.mooncake import EngineUnavailable
        with dockd.connect(sys.argv[1], warehouse=0) as r:
            try:
                r.get("c", ["x"], 1, partition=sys.argv[2], timeout=30)
            except EngineUnavailable as e:
                print("refused:", e)
    """)
    env = dict(broken_engine, DOCKD_TRANSPORT="mooncake")
    out = subprocess.run([sys.executable, "-c", code, address, partition], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "libibverbs" in out.stdout and "warehouse 1" in out.stdout, out.stdout


def test_which_readers_try_the_engine():
    """transport='mooncake': every warehouse (then the TCP fallback, which a required read never takes);
    'auto': warehouses on other hosts; 'tcp', and the controller's pool: never."""
    from dockd.config import ClientConfig
    from dockd.net.candidates import candidates
    from dockd.net.transport import Context, Endpoint

    def ctx(setting):
        return Context(config=ClientConfig(transport=setting))

    remote, local = Endpoint("192.0.2.1", 1, warehouse=0), Endpoint("127.0.0.1", 1, warehouse=0)
    Moon = mooncake.MooncakeTransport
    assert candidates(remote, ctx("mooncake"))[0] is Moon and candidates(local, ctx("mooncake"))[0] is Moon
    assert Moon in candidates(remote, ctx("auto")) and Moon not in candidates(local, ctx("auto"))
    assert Moon not in candidates(remote, ctx("tcp"))
    assert Moon not in candidates(Endpoint("192.0.2.1", 1), ctx("mooncake"))


def test_a_forked_child_reads_over_tcp_and_a_required_engine_says_why(mooncake_dock, partition, monkeypatch):
    """A process forked after its parent read with the engine (a DataLoader worker of a trainer that
    read already) inherits the engine object but none of its threads: its reads waited for the
    transfer timeout and failed, and a new engine started in the child hung. There the engine is
    unavailable: the child's client reads over TCP, bit-exact, and one that requires the engine
    fails at once saying why; the parent's engine goes on reading for the parent."""
    address, _, _ = mooncake_dock
    monkeypatch.setenv("DOCKD_TRANSPORT", "mooncake")
    values = [torch.full((1 << 16,), float(i)) for i in range(8)]  # 256 KiB each: engine reads
    with dockd.connect(address, warehouse=1) as w1, dockd.connect(address, warehouse=0) as w0:
        idx = w1.put({"x": values}, partition=partition)
        got = w0.get("parent", ["x"], 4, partition=partition, timeout=30)
        assert all(torch.equal(a, b) for a, b in zip(got["x"], values[:4]))
        reads = mooncake_engine.stats()["reads"]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # (reports through the pipe, and leaves without running the parent's exit code)
            out = ""
            try:
                with dockd.connect(address, warehouse=0, transport="mooncake") as required:
                    try:
                        required.get("child", ["x"], 8, partition=partition, timeout=30)
                        out = "a required engine read in the fork"
                    except dockd.DockError as e:
                        out = str(e)
                with dockd.connect(address, warehouse=0, transport="auto") as mine:
                    b = mine.get("child", ["x"], 8, partition=partition, timeout=30)
                    ok = b.indexes == idx and all(torch.equal(a, v) for a, v in zip(b["x"], values))
                    out += f"|{ok}|{mooncake_engine.stats()}"
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out += f"|{type(e).__name__}: {e}"
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        wait_child(pid, 90, "the forked child's read hung")
        with os.fdopen(r) as f:
            out = f.read()
        assert "is a fork of one that ran the Mooncake engine" in out and "spawn" in out, out
        assert out.endswith("|True|{}"), out  # over TCP, bit-exact, no engine in the child
        rest = w0.get("parent", ["x"], 4, partition=partition, timeout=30)  # the parent's engine still reads
        assert all(torch.equal(a, b) for a, b in zip(rest["x"], values[4:]))
        assert mooncake_engine.stats()["reads"] > reads
