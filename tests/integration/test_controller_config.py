"""Several controllers configured the way a newcomer might: lists (or token files) that disagree are refused,
never split; controllers of one host started without token files work; controllers on several hosts
without a daemon token are refused at start; a warehouse a controller refuses says why, once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import dockd
from dockd import owners
from dockd.controller.agreement import Agreement
from dockd.errors import DockConfigError, DockConnectionError
from dockd.local import free_ports, read_ready, spawn_node
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)


def _env(tmp_path, **extra) -> dict:
    """A daemon's environment with no daemon secret handed down (as `dockd serve` by hand), and
    its own runtime dir, where tokenless controllers leave their secret."""
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKD_DAEMON_SECRET", "DOCKD_TOKEN_FILE")}
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return dict(env, PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(runtime), **extra)


def _controller(port: int, listed: list[str], env: dict, *extra: str) -> subprocess.Popen:
    return spawn_node(["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", "--controller",
                       "--no-warehouse", "--controllers", ",".join(listed), "--log-level", "WARNING", *extra],
                      env=env)[0]


def _warehouse(join: str, env: dict, stderr, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "dockd", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--grpc-port", "0", "--join", join, *extra], stdout=subprocess.PIPE,
                            stderr=stderr, stdin=subprocess.DEVNULL, env=env)
    read_ready(proc)
    return proc


def _stop(procs: list) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _owned(controllers: list[str]) -> dict[str, str]:
    """One partition name owned by each controller (by the rule every daemon applies to this list)."""
    out: dict[str, str] = {}
    k = 0
    while len(out) < len(controllers):
        out.setdefault(controllers[owners.owner_index(f"p{k}", len(controllers))], f"p{k}")
        k += 1
    return out


def test_agreement_refuses_while_any_controller_differs_and_serves_again_once_fixed():
    a = Agreement(("h:1", "h:2"), "h:1")
    a.check(("h:1", "h:2"), "a warehouse")
    a.check((), "a client that knows one controller")  # (nothing to compare)
    with pytest.raises(DockConfigError, match="h:2,h:1.*restart the one that is wrong"):
        a.check(("h:2", "h:1"), "the warehouse at w:9")
    a.refuse()
    a.observed("h:2", ["h:2", "h:1"])
    with pytest.raises(DockConfigError, match=r"has --controllers h:1,h:2, the controller at h:2 has h:2,h:1"):
        a.refuse()
    a.observed("h:2", ["h:1", "h:2"])
    a.refuse()  # fixed: serving again
    a.observed("h:2", None, refusal="it refused ours")
    with pytest.raises(DockConfigError, match="it refused ours"):
        a.refuse()
    assert not owners.differs((), ("h:1",)) and owners.differs(("h:1",), ("h:1", "h:2"))


@pytest.mark.parametrize("second", ["reordered", "longer"])
def test_controllers_started_with_different_lists_refuse_service_until_they_agree(tmp_path, second):
    """Controller A with --controllers A,B; B with B,A (or A,B,C): both used to serve, and a put
    acknowledged by A was unknown to B. Now each finds the other's list within seconds and refuses
    every request, showing both lists; restarted with the same list, B serves and so does A."""
    env = _env(tmp_path)
    ports = free_ports("127.0.0.1", 3)
    a, b, c = (f"127.0.0.1:{p}" for p in ports)
    wrong = [b, a] if second == "reordered" else [a, b, c]
    procs = [_controller(ports[0], [a, b], env)]
    try:
        with open(tmp_path / "warehouse.log", "wb") as log:
            procs.append(_warehouse(a, env, log))
        early = dockd.connect(a)  # (connected before B is up: nothing disagrees yet)
        procs.insert(1, _controller(ports[1], wrong, env))

        def refused(address: str) -> str:
            try:
                dockd.connect(address, connect_timeout=5).close()
            except DockConfigError as e:
                return str(e)
            return ""

        for address in (a, b):
            msg = wait_until(lambda address=address: refused(address), 20, f"the controller at {address} refusing")
            assert ",".join([a, b]) in msg and ",".join(wrong) in msg and "--controllers" in msg, msg
        # a put through the warehouse is refused with the reason, not acknowledged by one of them
        with pytest.raises(DockConfigError, match="disagree on its controllers"):
            early.put({"x": [torch.ones(2)]}, partition=_owned([a, b])[a], timeout=10)
        early.close()
        # B restarted with A's list: the dock serves again, through either controller
        procs[1].terminate()
        procs[1].wait(10)
        procs[1].stdout.close()
        procs[1] = _controller(ports[1], [a, b], env)
        wait_until(lambda: not refused(a) and not refused(b), 40, "both controllers serving again")
        with dockd.connect(b) as dock:
            for owner, name in _owned([a, b]).items():
                dock.put({"x": [torch.full((2,), 7.0)]}, partition=name, timeout=30)
                got = dock.get("c", ["x"], 1, partition=name, timeout=30)
                assert got.indexes == [0] and got["x"][0].tolist() == [7.0, 7.0]
                assert dock.stats()["partitions"][name]["controller"] == owner
    finally:
        _stop(procs)



def test_controllers_of_one_host_without_token_files_share_their_daemon_secret(tmp_path):
    """The README's several-controller setup without --token-file and --daemon-token-file: each
    controller drew its own daemon secret, so a warehouse could join only the one it --joined, and
    puts of the other's partitions waited and failed as "unreachable". Now the controllers of one
    host share one secret: puts of every controller's partitions are committed."""
    env = _env(tmp_path)
    ports = free_ports("127.0.0.1", 2)
    listed = [f"127.0.0.1:{p}" for p in ports]
    procs = [_controller(p, listed, env) for p in ports]
    try:
        with open(tmp_path / "warehouse.log", "wb") as log:
            procs.append(_warehouse(listed[0], env, log))
        with dockd.connect(listed[1]) as dock:
            for name in _owned(listed).values():
                dock.put({"x": [torch.arange(3)]}, partition=name, timeout=10)
                assert dock.get("c", ["x"], 1, partition=name, timeout=10)["x"][0].tolist() == [0, 1, 2]
        assert b"never retrieved" not in (tmp_path / "warehouse.log").read_bytes()
    finally:
        _stop(procs)


def test_controllers_on_several_hosts_without_a_daemon_token_are_refused_at_start(tmp_path):
    """A controller whose list names another host, with no daemon token: warehouses could never
    prove themselves to all of them. It exits at once naming --daemon-token-file."""
    port = free_ports("127.0.0.1", 1)[0]
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--host", "127.0.0.1", "--port", str(port),
                          "--grpc-port", "0", "--controller", "--controllers", f"127.0.0.1:{port},192.0.2.7:7450"],
                         capture_output=True, env=_env(tmp_path), timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and time.monotonic() - t < 30
    assert b"192.0.2.7:7450" in out.stderr and b"--daemon-token-file" in out.stderr, out.stderr[-2000:]


def test_a_warehouse_a_controller_refuses_fails_puts_with_the_reason_and_does_not_spin(tmp_path):
    """Two controllers given different daemon tokens: the warehouse cannot join the second. Its
    puts of that controller's partitions used to wait out their timeout and fail as "unreachable",
    while it retried (and logged) every second with an unretrieved future each time. Now they fail
    with the reason, naming --daemon-token-file, and the warehouse tries again every few seconds."""
    env = _env(tmp_path)
    ports = free_ports("127.0.0.1", 2)
    listed = [f"127.0.0.1:{p}" for p in ports]
    tokens = []
    for k in range(2):
        tokens.append(tmp_path / f"daemon-token-{k}")
        tokens[k].write_text(f"{k}" * 64)
        tokens[k].chmod(0o600)
    client = tmp_path / "token"
    client.write_text("c" * 64)
    client.chmod(0o600)
    procs = [_controller(p, listed, env, "--token-file", str(client), "--daemon-token-file", str(tokens[k]))
             for k, p in enumerate(ports)]
    try:
        log_path = tmp_path / "warehouse.log"
        with open(log_path, "wb") as log:
            procs.append(_warehouse(listed[0], env, log, "--token-file", str(client),
                                    "--daemon-token-file", str(tokens[0])))
        with dockd.connect(listed[0], token="c" * 64) as dock:
            owned = _owned(listed)
            dock.put({"x": [torch.ones(1)]}, partition=owned[listed[0]], timeout=10)
            t = time.monotonic()
            with pytest.raises(DockConnectionError, match="--daemon-token-file") as e:
                dock.put({"x": [torch.ones(1)]}, partition=owned[listed[1]], timeout=20)
            assert time.monotonic() - t < 15, e.value
        time.sleep(3)
        text = log_path.read_bytes()
        assert b"never retrieved" not in text and text.count(b"refuses this warehouse") <= 2, text[-3000:]
    finally:
        _stop(procs)


def test_controllers_given_different_token_files_refuse_service_until_they_agree(tmp_path):
    """Controller A with --token-file a, B with b: both served, and a client holding a's token was refused
    by B only when its requests reached B. Now each finds that the other refuses it as a client and refuses
    service naming --token-file; B restarted with a's token, both serve."""
    env = _env(tmp_path)
    ports = free_ports("127.0.0.1", 2)
    listed = [f"127.0.0.1:{p}" for p in ports]
    files = []
    for name in ("a", "b"):
        files.append(tmp_path / f"token-{name}")
        files[-1].write_text(name * 64)
        files[-1].chmod(0o600)
    procs = [_controller(p, listed, env, "--token-file", str(f)) for p, f in zip(ports, files)]

    def refused(address: str, token: str) -> str:
        try:
            dockd.connect(address, token=token, connect_timeout=5).close()
        except DockConfigError as e:
            return str(e)
        return ""

    try:
        for address, token in zip(listed, ("a" * 64, "b" * 64)):
            msg = wait_until(lambda address=address, token=token: refused(address, token), 20,
                             f"the controller at {address} refusing")
            assert "do not take the same clients" in msg and "the same --token-file" in msg, msg
        procs[1].terminate()
        procs[1].wait(10)
        procs[1].stdout.close()
        procs[1] = _controller(ports[1], listed, env, "--token-file", str(files[0]))
        wait_until(lambda: not refused(listed[0], "a" * 64) and not refused(listed[1], "a" * 64), 40,
                   "both controllers serving again")
    finally:
        _stop(procs)


def test_agreement_takes_replicas_and_says_when_every_controller_agreed():
    a = Agreement(("h:1", "h:2", "h:3"), "h:1", replicas=2)
    a.observed("h:2", ["h:1", "h:2", "h:3"], their_replicas=2)
    assert not a.all_agree()  # (h:3 has not answered)
    a.observed("h:3", ["h:1", "h:2", "h:3"], their_replicas=1)
    with pytest.raises(DockConfigError, match=r"h:3 keeps --replicas 1, this controller \(h:1\) --replicas 2"):
        a.refuse()
    assert not a.all_agree()
    a.observed("h:3", ["h:1", "h:2", "h:3"], their_replicas=0)  # (a version that does not say: not compared)
    a.refuse()
    assert a.all_agree()
    a.observed("h:2", None, refusal="it refused ours")
    assert not a.all_agree()


@pytest.mark.slow
def test_controllers_record_their_list_once_they_agree_and_replicas_must_match(tmp_path):
    """Controller A with --replicas 2, B with 1: both used to serve, keeping A's partitions twice and B's
    once. Now they refuse service naming --replicas, and record no list in their state dirs while they
    disagree (a restart with the right settings is not refused). Once they agree the list is recorded,
    and B restarted on its dir under another list is refused at start."""
    env = _env(tmp_path)
    ports = free_ports("127.0.0.1", 2)
    a, b = (f"127.0.0.1:{p}" for p in ports)
    dirs = [tmp_path / "state-a", tmp_path / "state-b"]
    procs = [_controller(ports[0], [a, b], env, "--replicas", "2", "--state-dir", str(dirs[0])),
             _controller(ports[1], [a, b], env, "--replicas", "1", "--state-dir", str(dirs[1]))]

    def refusal(address: str) -> str:
        try:
            dockd.connect(address, connect_timeout=5).close()
        except DockConfigError as e:
            return str(e)
        return ""

    try:
        msg = wait_until(lambda: refusal(a), 30, "the controllers refusing over --replicas")
        assert "--replicas 1" in msg and "--replicas 2" in msg and "same --replicas" in msg, msg
        assert not any((d / owners.LIST_FILE).exists() for d in dirs)
        _stop(procs[1:])
        procs[1] = _controller(ports[1], [a, b], env, "--replicas", "2", "--state-dir", str(dirs[1]))
        wait_until(lambda: all((d / owners.LIST_FILE).exists() for d in dirs), 40, "both lists recorded")
        assert not refusal(a) and not refusal(b)
        _stop(procs[1:])
        wrong = subprocess.run([sys.executable, "-m", "dockd", "serve", "--host", "127.0.0.1", "--port",
                                str(ports[1]), "--grpc-port", "0", "--controller", "--no-warehouse", "--controllers",
                                f"{b},{a}", "--replicas", "2", "--state-dir", str(dirs[1])],
                               env=env, capture_output=True, text=True, timeout=60)
        assert wrong.returncode != 0 and "was kept by a controller started with" in wrong.stderr, wrong.stderr
    finally:
        _stop(procs)
