"""Two nodes in their own network namespaces, linked by a veth pair: writes land on
the writer's node, reads fetch across the link, the controller moves no payload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest

from dockd.local import spawn_node

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(240)]


def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True)


@pytest.fixture
def token(tmp_path):
    """Binding addresses beyond loopback takes a token: every daemon and client proves it."""
    path = tmp_path / "token"
    path.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"dockdA{tag}", f"dockdB{tag}"
    try:
        _sh(f"ip netns add {a} && ip netns add {b}")
        _sh(f"ip link add va{tag} type veth peer name vb{tag}")
        _sh(f"ip link set va{tag} netns {a} && ip link set vb{tag} netns {b}")
        _sh(f"ip -n {a} addr add 10.77.0.1/24 dev va{tag} && ip -n {b} addr add 10.77.0.2/24 dev vb{tag}")
        for ns, dev in ((a, f"va{tag}"), (b, f"vb{tag}")):
            _sh(f"ip -n {ns} link set lo up && ip -n {ns} link set {dev} up")
    except subprocess.CalledProcessError as e:
        subprocess.run(f"ip netns del {a}; ip netns del {b}", shell=True, capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    procs: list[subprocess.Popen] = []
    try:
        yield a, b, procs
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        subprocess.run(f"ip netns del {a}; ip netns del {b}", shell=True, capture_output=True)


def run_in(ns: str, code: str, *args: str, token: str, to_files: bool = False) -> str:
    """Run `code` in namespace `ns`; its stdout. `to_files`: collect the output through files, not
    pipes (a process sharing CPU tensors starts torch's shared-memory manager, which inherits the
    pipes and would hold them open after the process ends)."""
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", textwrap.dedent(code), *args]
    env = dict(os.environ, DOCKD_TOKEN_FILE=token)
    if not to_files:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        rc = subprocess.run(cmd, stdout=so, stderr=se, text=True, timeout=120, env=env).returncode
        so.seek(0)
        se.seek(0)
        assert rc == 0, se.read()
        return so.read()


WRITE = """
import sys, json, torch, dockd
with dockd.connect(sys.argv[1]) as d:
    if sys.argv[2] == "new":
        idx = d.put({"prompts": torch.arange(64 * 1024, dtype=torch.int32).view(64, 1024)}, partition="p")
    else:
        idx = d.put({"responses": torch.ones(64, 4096, dtype=torch.bfloat16)}, partition="p", indexes=list(range(64)))
    print(json.dumps({"home": d.home, "indexes": idx}))
"""

READ = """
import sys, json, torch, dockd
with dockd.connect(sys.argv[1]) as d:
    b = d.get(sys.argv[2], ["prompts", "responses"], 64, partition="p", timeout=30)
    ok = torch.equal(torch.stack(b["prompts"]), torch.arange(64 * 1024, dtype=torch.int32).view(64, 1024))
    ok &= all(torch.equal(r, torch.ones(4096, dtype=torch.bfloat16)) for r in b["responses"])
    print(json.dumps({"ok": bool(ok), "indexes": b.indexes, "stats": d.stats()["warehouses"]}))
"""


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_writes_stay_on_the_writers_node_and_reads_cross_the_link(two_hosts, token, tmp_path):
    a, b, procs = two_hosts
    daemon_token = tmp_path / "daemon-token"  # what lets a warehouse on another host join
    daemon_token.write_text(uuid.uuid4().hex * 2)
    daemon_token.chmod(0o600)
    daemon_token = str(daemon_token)
    p0, ready0 = spawn_node(["--host", "10.77.0.1", "--port", "0", "--controller", "--token-file", token,
                             "--daemon-token-file", daemon_token], prefix=["ip", "netns", "exec", a])
    procs.append(p0)
    controller = f"10.77.0.1:{ready0['port']}"
    p1, ready1 = spawn_node(["--host", "10.77.0.2", "--port", "0", "--join", controller, "--token-file", token,
                             "--daemon-token-file", daemon_token], prefix=["ip", "netns", "exec", b])
    procs.append(p1)

    wrote_b = json.loads(run_in(b, WRITE, controller, "new", token=token))      # a rollout worker on host B
    assert wrote_b == {"home": ready1["warehouse"], "indexes": list(range(64))}
    wrote_a = json.loads(run_in(a, WRITE, controller, "more", token=token))     # a reward worker on host A
    assert wrote_a["home"] == ready0["warehouse"]

    for ns, consumer in ((a, "trainer_on_a"), (b, "trainer_on_b")):
        got = json.loads(run_in(ns, READ, controller, consumer, token=token))
        assert got["ok"] and got["indexes"] == list(range(64))
    whs = {int(k): v for k, v in got["stats"].items()}
    # each column lives only where it was written: 256 KiB of prompts on B, 512 KiB of responses on A
    assert 256 * 1024 <= whs[ready1["warehouse"]]["bytes"] < 300 * 1024
    assert 512 * 1024 <= whs[ready0["warehouse"]]["bytes"] < 560 * 1024


DEVICE_WRITE = """
import sys, torch, dockd
with dockd.connect(sys.argv[1]) as d:
    d.put({"logp": (torch.arange(64 * 2048) % 977).float().view(64, 2048)}, partition="dev", device="keep")
    assert d.stats(traffic=True)["warehouses"][d.home]["device_bytes"] == 64 * 2048 * 4
"""

DEVICE_READ = """
import sys, json, torch, dockd
with dockd.connect(sys.argv[1]) as d:
    out = []
    for k in range(2):  # the first read opens the link, the second reuses it
        b = d.get("trainer", ["logp"], 32, partition="dev", device="cpu", timeout=30)
        want = (torch.arange(64 * 2048) % 977).float().view(64, 2048)[b.indexes]
        out.append(bool(torch.equal(b.stacked("logp"), want)))
    print(json.dumps({"ok": out, "links": len(d._links._links), "off": d._links._off}))
"""


def test_a_reader_on_another_node_gets_device_tier_data_over_a_device_link(two_hosts, token):
    """The device link across a real network link (gloo, the CPU stand-in: DOCKD_CPU_DEVICE_TIER=1):
    the rendezvous and the holder's address are the nodes' own addresses, not loopback."""
    a, b, procs = two_hosts
    env = dict(os.environ, DOCKD_CPU_DEVICE_TIER="1", DOCKD_DEVICE_LINK_TIMEOUT="30")
    p0, ready0 = spawn_node(["--host", "10.77.0.1", "--port", "0", "--controller", "--token-file", token,
                             "--device-capacity", "8MiB"], prefix=["ip", "netns", "exec", a], env=env)
    procs.append(p0)
    controller = f"10.77.0.1:{ready0['port']}"
    os.environ["DOCKD_CPU_DEVICE_TIER"] = "1"   # (run_in passes the environment on)
    try:
        run_in(a, DEVICE_WRITE, controller, token=token, to_files=True)            # a rollout worker on host A
        got = json.loads(run_in(b, DEVICE_READ, controller, token=token, to_files=True))  # the trainer on host B
    finally:
        del os.environ["DOCKD_CPU_DEVICE_TIER"]
    assert got == {"ok": [True, True], "links": 1, "off": {}}
