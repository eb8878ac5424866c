"""dockd.ray on a Ray cluster of three nodes on this machine (ray.cluster_utils.Cluster).

One cluster and one launched dock serve the whole module (start-up is the slow
part on 2 cores); the tests run in file order and the last one shuts the dock
down. Every node of a Cluster has the same IP, so the only way a worker's puts
land on its own node's warehouse is dockd.ray.connect() picking it by Ray node id.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dockd
from dockd import ray as dock_ray
from tests.conftest import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
slow = pytest.mark.slow

_NODE: dict[str, Any] = {"num_cpus": 2, "object_store_memory": 80 * 1024**2}
# the folders of token files in the temp dir before this module launched anything (see the last test)
_TOKEN_FOLDERS = set(glob.glob(os.path.join(tempfile.gettempdir(), "dockd-ray-*")))


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


def _refuses(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except OSError:
        return True
    return False


# -- without Ray --------------------------------------------------------------------------
def test_import_dockd_never_imports_ray() -> None:
    code = "import sys, dockd, dockd.ray; print('ray' in sys.modules, dockd.ray.ray_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_missing_ray_names_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None           # as if Ray were not installed
        import dockd.ray
        try:
            dockd.ray.launch()
        except ImportError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "pip install -e '.[ray]'" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_daemon_dies_with_a_sigkilled_owner() -> None:
    """The exec wrapper the actors start daemons through: SIGKILL the owner, the child follows."""
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import subprocess, sys, time
            from dockd._ray.actors import death_tie_prefix
            child = subprocess.Popen([*death_tie_prefix(), "/bin/sleep", "120"])
            print(child.pid, flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        child = int(owner.stdout.readline())
        time.sleep(0.3)
        assert not _gone(child)
        with open(f"/proc/{child}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"/bin/sleep"  # the wrapper exec'd into the program
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_until(lambda: _gone(child), 10, f"child pid={child} to die with its owner", interval=0.2)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()


def test_functions_need_an_initialized_ray() -> None:
    pytest.importorskip("ray")
    code = textwrap.dedent("""
        import dockd.ray
        for fn in (dockd.ray.launch, dockd.ray.find, dockd.ray.connect, dockd.ray.shutdown):
            try:
                fn()
            except RuntimeError as e:
                print("ray.init()" in str(e))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True"] * 4


# -- on a three-node Ray cluster ------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    env = pytest.MonkeyPatch()
    env.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a FutureWarning of ray.init
    for name in ("DOCKD_ADDRESS", "DOCKD_WAREHOUSE", "DOCKD_OPENRLHF_CONFIG", "DOCKD_TRANSFER_QUEUE"):
        env.delenv(name, raising=False)
    cluster = Cluster(initialize_head=True, head_node_args={**_NODE, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(**_NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        try:
            if ray.is_initialized():
                dock_ray.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            env.undo()


@pytest.fixture(scope="module")
def dock_address(ray_cluster: Any) -> Iterator[str]:
    address = dock_ray.launch("256MiB", lease_timeout=30.0, watch_interval=0.5, replicas=2)
    try:
        yield address
    finally:
        dock_ray.shutdown()


def _alive_node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _live(whs: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {wid: w for wid, w in whs.items() if w["alive"]}


def _live_warehouses(dock: dockd.Dock) -> dict[int, dict[str, Any]]:
    return _live(dock.stats()["warehouses"])


def _pinned(fn: Any, node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def _put_here_task() -> Any:
    import ray

    @ray.remote(num_cpus=0.1)
    def put_here(partition: str, n: int, seed: int) -> tuple[str, int, list[int], list[torch.Tensor]]:
        from dockd import ray as dock_ray

        gen = torch.Generator().manual_seed(seed)
        values = [torch.randn(int(torch.randint(1, 300, (1,), generator=gen)), generator=gen).bfloat16()
                  for _ in range(n)]
        with dock_ray.connect() as dock:
            idx = dock.put({"x": values}, partition=partition)
            return ray.get_runtime_context().get_node_id(), int(dock.home), list(idx), values

    return put_here


@slow
def test_one_warehouse_per_node(dock_address: str) -> None:
    infos = dock_ray.warehouses()
    nodes = _alive_node_ids()
    assert len(nodes) == 3
    assert set(infos) == nodes  # keyed by the node each actor measured it runs on
    assert sorted(i["role"] for i in infos.values()) == ["controller", "warehouse", "warehouse"]
    assert all(i["running"] for i in infos.values())
    assert len({i["pid"] for i in infos.values()}) == 3
    controller = next(i for i in infos.values() if i["role"] == "controller")
    assert controller["address"] == dock_address
    with dockd.connect(dock_address) as dock:
        live = _live_warehouses(dock)
    assert len(live) == 3
    assert {w["address"] for w in live.values()} == {i["address"] for i in infos.values()}
    assert set(live) == {i["warehouse"] for i in infos.values()}


@slow
def test_tasks_put_to_their_own_nodes_warehouse(dock_address: str) -> None:
    import ray

    infos = dock_ray.warehouses()
    partition = f"ray-{uuid.uuid4().hex[:8]}"
    put_here = _put_here_task()
    refs = {nid: _pinned(put_here, nid).remote(partition, 6, seed) for seed, nid in enumerate(sorted(infos))}
    results = {nid: ray.get(ref, timeout=120) for nid, ref in refs.items()}
    expected: dict[int, torch.Tensor] = {}
    for nid, (ran_on, home, idx, values) in results.items():
        assert ran_on == nid
        assert home == infos[nid]["warehouse"], f"the task on node {nid} wrote to warehouse {home}"
        expected.update(zip(idx, values, strict=True))
    with dockd.connect(dock_address) as dock:
        held = {wid: w["bytes"] for wid, w in _live_warehouses(dock).items()}
        for _, home, _, values in results.values():
            assert held[home] >= sum(v.numel() * v.element_size() for v in values), held
        batch = dock.get("driver", ["x"], count=len(expected), partition=partition, timeout=60)
        assert sorted(batch.indexes) == sorted(expected)
        for i, value in zip(batch.indexes, batch["x"], strict=True):
            assert value.dtype == torch.bfloat16
            assert torch.equal(value.view(torch.int16), expected[i].view(torch.int16))
        dock.clear(partition)


@slow
def test_launch_again_finds_the_running_dock(dock_address: str) -> None:
    before = dock_ray.warehouses()
    assert dock_ray.launch("256MiB") == dock_address
    assert dock_ray.find() == dock_address
    assert dock_ray.find("another-namespace") is None
    after = dock_ray.warehouses()
    assert {n: i["pid"] for n, i in after.items()} == {n: i["pid"] for n, i in before.items()}
    with dockd.connect(dock_address) as dock:
        assert len(_live_warehouses(dock)) == 3


@slow
def test_killed_warehouse_actor_takes_its_daemon_and_is_replaced(dock_address: str) -> None:
    import ray

    infos = dock_ray.warehouses()
    nid, old = next((n, i) for n, i in sorted(infos.items()) if i["role"] == "warehouse")
    with dockd.connect(dock_address, warehouse=old["address"]) as writer:  # (the dock keeps two replicas)
        kept = writer.put({"x": list(range(8))}, partition="kept")
    ray.kill(ray.get_actor(dock_ray.WAREHOUSE_PREFIX + nid, namespace="dockd"))  # SIGKILLs the actor
    wait_until(lambda: _gone(old["pid"]), 30, f"daemon pid={old['pid']} to die with its actor", interval=0.2)

    def replaced() -> dict[str, Any] | None:
        info = dock_ray.warehouses().get(nid)
        return info if info and info["running"] and info["pid"] != old["pid"] else None

    new = wait_until(replaced, 90, f"a new warehouse on node {nid}", interval=0.2)
    assert new["controller"] == dock_address
    with dockd.connect(dock_address) as dock:
        # the controller may give a dropped warehouse a grace period to rejoin before retiring it
        wait_until(lambda: not dock.stats()["warehouses"][old["warehouse"]]["alive"], 60,
                   "the controller to retire the killed warehouse", interval=0.2)
        whs = dock.stats()["warehouses"]
    assert whs[new["warehouse"]]["alive"] is True
    assert len(_live(whs)) == 3
    with dockd.connect(dock_address) as dock:  # what it held is read from the replicas
        got = dock.get("c", ["x"], 8, partition="kept", timeout=30)
        assert sorted(got.indexes) == kept and sorted(got["x"]) == list(range(8))


@slow
def test_late_node_gets_a_warehouse_and_a_leaving_node_takes_it_along(
    ray_cluster: Any, dock_address: str
) -> None:
    import ray

    node = ray_cluster.add_node(**_NODE)
    nid = node.node_id
    try:
        info = wait_until(lambda: (i := dock_ray.warehouses().get(nid)) and i["running"] and i, 90,
                          f"a warehouse on the new node {nid}", interval=0.2)
        partition = f"late-{uuid.uuid4().hex[:8]}"
        ran_on, home, idx, _ = ray.get(_pinned(_put_here_task(), nid).remote(partition, 3, 99), timeout=120)
        assert (ran_on, home) == (nid, info["warehouse"])
        with dockd.connect(dock_address) as dock:
            assert len(_live_warehouses(dock)) == 4
            dock.clear(partition)
    finally:
        ray_cluster.remove_node(node)
    wait_until(lambda: _gone(info["pid"]), 60, f"daemon pid={info['pid']} to end with its node", interval=0.2)
    with dockd.connect(dock_address) as dock:
        wait_until(lambda: not dock.stats()["warehouses"][info["warehouse"]]["alive"], 60,
                   "the controller to see the warehouse leave", interval=0.2)
        assert len(_live_warehouses(dock)) == 3


@slow
def test_plugins_find_the_dock_on_ray(dock_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openrlhf")
    from dockd.trainer_plugins import openrlhf
    from dockd.trainer_plugins.verl import transfer_queue, use_dockd_transfer_queue

    monkeypatch.delenv("DOCKD_ADDRESS", raising=False)
    monkeypatch.delenv(openrlhf.ENV_CONFIG, raising=False)
    try:
        runtime_env = openrlhf.install(name="onray")
        assert runtime_env["env_vars"]["DOCKD_ADDRESS"] == dock_address
        from openrlhf.trainer.ppo_utils import NaiveReplayBuffer

        assert NaiveReplayBuffer(2).config.address == dock_address
    finally:
        openrlhf.uninstall()
    monkeypatch.delenv("DOCKD_ADDRESS", raising=False)
    try:
        runtime_env = use_dockd_transfer_queue()
        assert runtime_env["env_vars"]["DOCKD_ADDRESS"] == dock_address
        assert os.environ["DOCKD_ADDRESS"] == dock_address
    finally:
        transfer_queue.uninstall()


@slow
def test_a_dead_controller_is_replaced_by_the_next_launch(dock_address: str) -> None:
    import ray

    ctrl = next(i for i in dock_ray.warehouses().values() if i["role"] == "controller")
    ray.kill(ray.get_actor(dock_ray.CONTROLLER_NAME, namespace="dockd"))
    wait_until(lambda: _gone(ctrl["pid"]), 30, f"controller pid={ctrl['pid']} to die with its actor", interval=0.2)
    assert dock_ray.find() is None
    address = dock_ray.launch("256MiB", lease_timeout=30.0, watch_interval=0.5)
    assert address != dock_address
    infos = dock_ray.warehouses()
    assert set(infos) == _alive_node_ids()
    assert all(i["running"] and i["controller"] == address for i in infos.values())
    with dockd.connect(address) as dock:
        assert len(_live_warehouses(dock)) == 3


@slow
def test_shutdown_leaves_nothing_and_a_plugin_launches_anew(dock_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs last: it stops the module's dock."""
    import ray

    from dockd.trainer_plugins.verl import transfer_queue

    def stopped(infos: dict[str, dict[str, Any]]) -> None:
        assert dock_ray.find() is None
        assert not {n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == "dockd"}
        for info in infos.values():
            pid = info["pid"]
            wait_until(lambda pid=pid: _gone(pid), 30, f"daemon pid={pid} to exit", interval=0.2)
            assert _refuses(info["address"])

    infos = dock_ray.warehouses()
    assert len(infos) == 3
    # the dock's tokens were written for its daemons to read as they started, and removed once they did
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "dockd-ray-*"))) - _TOKEN_FOLDERS
    assert not left, f"token files left behind: {sorted(left)[:3]}"
    dock_ray.shutdown()
    stopped(infos)
    dock_ray.shutdown()  # idempotent
    with pytest.raises(dockd.DockConnectionError, match="dockd.ray.launch"):
        dock_ray.connect()

    monkeypatch.delenv("DOCKD_ADDRESS", raising=False)
    try:
        runtime_env = transfer_queue.install()  # no dock runs: it launches one
        address = runtime_env["env_vars"]["DOCKD_ADDRESS"]
        assert address != dock_address and dock_ray.find() == address
        infos = dock_ray.warehouses()
        assert len(infos) == 3 and set(infos) == _alive_node_ids()
    finally:
        transfer_queue.uninstall()
        dock_ray.shutdown()
    stopped(infos)
