"""--shards on the daemons: refused at start where it cannot work; part of the dock's identity (two
controllers with different --shards refuse service, as with different --controllers lists); clients
and warehouses learn it in their hello; a request naming a spread partition's own name (an old
client, a raw request) is refused with what to do, and the daemon keeps serving; a shard is an
ordinary partition on the controller `owners.owner_index` names."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import dockd
from dockd import owners
from dockd._proto import dockd_pb2 as pb
from dockd.controller.agreement import Agreement
from dockd.errors import DockConfigError
from dockd.local import free_ports
from dockd.net import wire
from tests.conftest import RawClient, wait_until
from tests.integration.test_controller_config import _controller, _env, _stop

pytestmark = pytest.mark.timeout(180)

SPREAD = "rollouts"
REFUSED = f"partition '{SPREAD}' is spread over 2 shards"
HELLO = pb.Frame(id=2, hello=pb.Hello(client="raw", protocol=wire.PROTOCOL_VERSION))


@pytest.mark.parametrize("how, args, says", [
    ("without --controllers", ["--shards", "r=2"], "give every controller --controllers"),
    ("on a warehouse", ["--join", "127.0.0.1:1", "--shards", "r=2"], "--shards goes with --controller"),
    ("more shards than controllers", ["--controllers", "{a},{b}", "--shards", "r=3"], "2 to 2 shards with 2"),
    ("malformed", ["--controllers", "{a},{b}", "--shards", "r:2"], "is not NAME=COUNT"),
])
def test_shards_are_refused_at_start_naming_the_fix(tmp_path, how, args, says):
    ports = free_ports("127.0.0.1", 2)
    a, b = (f"127.0.0.1:{p}" for p in ports)
    role = [] if "--join" in args else ["--controller"]
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--host", "127.0.0.1", "--port", str(ports[0]),
                          "--grpc-port", "0", *role, *(x.format(a=a, b=b) for x in args)],
                         capture_output=True, env=_env(tmp_path), timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and time.monotonic() - t < 30, (how, out.stderr[-2000:])
    assert says.encode() in out.stderr, (how, out.stderr[-2000:])


def test_agreement_compares_the_shards_with_the_list():
    a = Agreement(("h:1", "h:2"), "h:1", {"r": 2})
    a.check(("h:1", "h:2"), "a warehouse", ["r=2"])
    a.check((), "a client that knows no controller yet")  # (nothing to compare)
    with pytest.raises(DockConfigError, match=r"--shards r=2, a client has \(none\).*predate --shards"):
        a.check(("h:1", "h:2"), "a client", [])
    a.observed("h:2", ["h:1", "h:2"], their_shards=["q=2", "r=2"])
    with pytest.raises(DockConfigError, match=r"this controller \(h:1\) has --shards r=2, the controller at h:2 has "
                                              r"q=2,r=2"):
        a.refuse()
    a.observed("h:2", ["h:1", "h:2"], their_shards=["r=2"])
    a.refuse()  # the same again: serving


def test_controllers_with_different_shards_refuse_service(tmp_path):
    env = _env(tmp_path)
    ports = free_ports("127.0.0.1", 2)
    a, b = (f"127.0.0.1:{p}" for p in ports)
    procs = [_controller(ports[0], [a, b], env, "--shards", "r=2"),
             _controller(ports[1], [a, b], env, "--shards", "r=2,q=2")]
    def refusal(address: str) -> str:  # (what dockd.connect raises as DockConfigError)
        with RawClient(address) as c:
            return c.call(HELLO).hello_reply.disagreement

    try:
        for address in (a, b):
            msg = wait_until(lambda address=address: refusal(address), 20, f"the controller at {address} refusing")
            assert "disagree on its spread partitions" in msg and "--shards" in msg, msg
            assert "q=2,r=2" in msg and ("has r=2" in msg or "has --shards r=2" in msg), msg  # (both, either side)
    finally:
        _stop(procs)


def _put(partition: str) -> pb.Frame:
    req = pb.PutRequest(partition=partition, new_count=1, group_size=1, timeout=5)
    req.columns.add(name="x").runs.add(kind=pb.TENSOR, count=1, dtype="float32", shape=[4], offset=0, nbytes=16)
    return pb.Frame(id=1, put=req)


def test_a_dock_with_shards_tells_clients_and_refuses_the_spread_name(raw):
    with dockd.start_local(num_warehouses=3, controllers=2, shards={SPREAD: 2}) as cluster, \
            dockd.connect(cluster.address) as dock:
        assert dock._router.shards == {SPREAD: 2}
        joined = raw(cluster.warehouses[2])  # a warehouse that joined: it learned the shards from its controller
        assert list(joined.call(HELLO).hello_reply.shards) == [f"{SPREAD}=2"]
        reply = joined.call(_put(SPREAD), bytes(16))
        assert reply.status.code == pb.INVALID_ARGUMENT and REFUSED in reply.status.message, reply.status
        assert "connect with a current client" in reply.status.message
        for address in cluster.controllers:  # both controllers, the spread name's owner and the other
            c = raw(address)
            acquire = pb.AcquireRequest(partition=SPREAD, consumer="c", columns=["x"], count=1, timeout=0)
            create = pb.PartitionRequest(partition=SPREAD, create=pb.CreatePartition(group_size=1))
            for frame in (pb.Frame(id=3, acquire=acquire), pb.Frame(id=4, partition=create)):
                reply = c.call(frame)
                assert reply.status.code == pb.INVALID_ARGUMENT and REFUSED in reply.status.message, reply.status
            # a client that presents the list but no shards (one of a dockd before --shards) is told so
            old = c.call(pb.Frame(id=5, hello=pb.Hello(client="old", protocol=wire.PROTOCOL_VERSION,
                                                       controllers=cluster.controllers)))
            assert old.status.code == pb.CONFIG and "predate --shards" in old.status.message, old.status
        assert SPREAD not in dock.stats()["partitions"]  # nothing recorded under the spread name
        # a shard is an ordinary partition on the controller owner_index names; the daemons keep serving
        for k in range(2):
            name = owners.shard_name(SPREAD, k, 2)
            assert dock.put({"x": [torch.full((4,), float(k))]}, partition=name, timeout=30) == [0]
            got = dock.get("c", ["x"], 1, partition=name, timeout=30)
            assert got["x"][0].tolist() == [float(k)] * 4
            owner = cluster.controllers[owners.owner_index(name, 2)]
            assert dock.stats()["partitions"][name]["controller"] == owner
        assert {owners.owner_index(owners.shard_name(SPREAD, k, 2), 2) for k in range(2)} == {0, 1}
