"""verl 0.9's V1 ReplayBuffer (trainer.v1) on dockd's transfer_queue switch, against real daemons.

The replay buffer keeps GRPO groups in transfer_queue's key-value store: one tag-only key per
prompt (``{uid}``, its status going pending -> running -> finished / failure) and one key per
trajectory (``{uid}_{session}_{index}``, fields and tags). These tests drive verl's own
``ReplayBuffer`` / ``ReplayBufferAsync`` through each path it relies on: tag-only keys and tag
merges, metadata sync, sampling order and blocking, DAPO filtering with eviction and refill,
off-policy drop and wait, failed groups, and what ``kv_clear`` frees in the dock.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dockd

pytest.importorskip("verl.protocol")
from tensordict import NonTensorStack, TensorDict

from dockd.trainer_plugins import verl as plugin

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

POLL = 0.02  # the replay buffer's poll interval here: short, so blocked samples react quickly


def _load_replay_buffer() -> Any:
    """verl's replay_buffer module. ``verl.trainer.ppo.v1``'s package imports the whole V1 trainer
    (agent loop, datasets, ...); where some of that is not installed, load the module file alone:
    it imports only numpy, omegaconf, transfer_queue and verl.utils.skip."""
    try:
        return importlib.import_module("verl.trainer.ppo.v1.replay_buffer")
    except ImportError:
        from verl.trainer import ppo

        path = Path(ppo.__file__).parent / "v1" / "replay_buffer.py"
        spec = importlib.util.spec_from_file_location("dockd_tests_verl_v1_replay_buffer", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


@pytest.fixture(scope="module")
def tq(dock_cluster: dockd.LocalCluster) -> Iterator[Any]:
    from dockd.trainer_plugins.verl import transfer_queue as compat

    plugin.use_dockd_transfer_queue(dock_cluster.address)
    import transfer_queue

    assert transfer_queue is compat
    compat.init()
    yield compat
    compat.uninstall()


@pytest.fixture(scope="module")
def rbmod(tq: Any) -> Any:
    module = _load_replay_buffer()
    assert module.tq is tq  # verl's module talks to the switch
    return module


def _empty(tq: Any, pid: str) -> None:
    keys = list(tq.kv_list(pid).get(pid, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=pid)


@pytest.fixture()
def pid(tq: Any) -> Iterator[str]:
    """verl's training partition, emptied around each test (the buffer names its metrics after it)."""
    _empty(tq, "train")
    yield "train"
    _empty(tq, "train")


def _uid() -> str:
    return uuid.uuid4().hex  # no "_": the replay buffer splits trajectory keys on it


def _register(tq: Any, pid: str, uids: list[str], step: int) -> None:
    """What verl's trainer does when it sends prompts to rollout: tag-only keys, status pending."""
    tq.kv_batch_put(keys=uids, partition_id=pid,
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids])


def _finish(tq: Any, pid: str, uid: str, *, rewards: list[float] | None = None, sessions: int = 2,
            status: str = "finished", canonical: bool = False) -> list[str]:
    """What verl's agent loop does for one group: running, its trajectories, then the final status
    (tag updates name only ``status``: the rest of the prompt's tag must stay)."""
    tq.kv_put(key=uid, partition_id=pid, tag={"status": "running"})
    keys = [f"{uid}_{s}_0" for s in range(sessions)]
    if sessions:
        rw = rewards if rewards is not None else [float(s) for s in range(sessions)]
        fields: dict[str, Any] = {"input_ids": torch.arange(4 * sessions).view(sessions, 4)}
        if canonical:
            fields["rm_scores"] = torch.tensor([[0.0, r] for r in rw])  # summed per trajectory
        else:
            fields["extra_fields"] = NonTensorStack.from_list([{"reward_extra_info": {"acc": r}} for r in rw])
        tq.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(fields, batch_size=sessions),
                        tags=[{"is_prompt": False, "global_steps": 0} for _ in keys])
    tq.kv_put(key=uid, partition_id=pid, tag={"status": status})
    return keys


def _group(tq: Any, pid: str, step: int, **kw: Any) -> tuple[str, list[str]]:
    uid = _uid()
    _register(tq, pid, [uid], step)
    return uid, _finish(tq, pid, uid, **kw)


def _rb(rbmod: Any, mode: str = "sync", **kw: Any) -> Any:
    cls = rbmod.ReplayBuffer if mode == "sync" else rbmod.ReplayBufferAsync
    args: dict[str, Any] = {"trainer_mode": mode, "trainer_config": {}, "max_off_policy_threshold": 4,
                            "max_off_policy_strategy": "drop", "sampler_kwargs": {}, "poll_interval": POLL,
                            "train_batch_size": 2, "gen_batch_size": 1}
    args.update(kw)
    return cls(**args)


class _Refill:
    """The trainer's refill_fn: dispatches `n` fresh prompts, here finished at once."""

    def __init__(self, tq: Any, pid: str, step: int, rewards: list[float] | None = None) -> None:
        self.tq, self.pid, self.step, self.rewards = tq, pid, step, rewards
        self.calls: list[int] = []
        self.uids: list[str] = []

    def __call__(self, n: int) -> int:
        self.calls.append(n)
        for _ in range(n):
            self.uids.append(_group(self.tq, self.pid, self.step, rewards=self.rewards)[0])
        return n


def _sample_in_thread(rb: Any, pid: str, batch_size: int, step: int) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["batch"], out["metrics"] = rb.sample(global_steps=step, partition_id=pid, batch_size=batch_size)
        except Exception as e:  # noqa: BLE001 - handed to the test, which asserts there is none
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _data_partition(dock: dockd.Dock, pid: str) -> dict[str, Any]:
    parts = dock.stats()["partitions"]
    names = [p for p in parts if p.startswith(f"tq/{pid}/g")]
    assert len(names) == 1, names
    return parts[names[0]]


# -- the key-value paths the replay buffer relies on -----------------------------------------
def test_tag_only_keys_hold_tags_and_merge_updates(tq: Any, pid: str) -> None:
    meta = tq.kv_batch_put(keys=["p1", "p2"], partition_id=pid,
                           tags=[{"is_prompt": True, "status": "pending", "global_steps": 3}] * 2)
    assert meta.fields == [] and meta.tags == [{"is_prompt": True, "status": "pending", "global_steps": 3}] * 2
    one = tq.kv_put(key="p1", partition_id=pid, tag={"status": "running"})  # merged, not replaced
    assert one.tags == [{"is_prompt": True, "status": "running", "global_steps": 3}] and one.fields == []
    listed = tq.kv_list(pid)[pid]
    assert listed == {"p1": {"is_prompt": True, "status": "running", "global_steps": 3},
                      "p2": {"is_prompt": True, "status": "pending", "global_steps": 3}}
    assert pid in tq.kv_list()  # listing every partition includes it
    # a tag-only key reads as a row without fields; asking it for a field is an error
    empty = tq.kv_batch_get(keys=["p1", "p2"], partition_id=pid)
    assert tuple(empty.batch_size) == (2,) and list(empty.keys()) == []
    with pytest.raises(ValueError, match="no fields"):
        tq.kv_batch_get(keys=["p1"], partition_id=pid, select_fields=["input_ids"])
    # tags written from another thread's async call are seen here too
    import asyncio

    asyncio.run(tq.async_kv_put(key="p2", partition_id=pid, tag={"status": "failure"}))
    assert tq.kv_list(pid)[pid]["p2"]["status"] == "failure"
    # clearing names a key that does not exist: ignored, as TransferQueue does
    tq.kv_clear(keys=["p1", "never-put"], partition_id=pid)
    assert list(tq.kv_list(pid)[pid]) == ["p2"]


def test_tag_only_key_gets_data_next_to_new_and_existing_keys(tq: Any, dock: dockd.Dock, pid: str) -> None:
    tq.kv_batch_put(keys=["old"], partition_id=pid, fields=TensorDict({"x": torch.tensor([[1, 1]])}, batch_size=1))
    tq.kv_put(key="tagged", partition_id=pid, tag={"status": "pending"})
    # one put names a key with data, a tag-only key and a new key (verl's async trainer persists
    # prompt data on keys it registers with tags)
    meta = tq.kv_batch_put(keys=["tagged", "old", "new"], partition_id=pid,
                           fields=TensorDict({"y": torch.tensor([[10], [20], [30]])}, batch_size=3),
                           tags=[{"n": 0}, {"n": 1}, {"n": 2}])
    assert meta.fields == ["x", "y"]  # every field the written keys hold
    assert meta.tags == [{"status": "pending", "n": 0}, {"n": 1}, {"n": 2}]
    got = tq.kv_batch_get(keys=["new", "tagged", "old"], partition_id=pid, select_fields=["y"])
    assert torch.equal(got["y"], torch.tensor([[30], [10], [20]]))
    both = tq.kv_batch_get(keys="old", partition_id=pid)
    assert sorted(both.keys()) == ["x", "y"] and torch.equal(both["x"], torch.tensor([[1, 1]]))
    assert _data_partition(dock, pid)["columns"] == {"x": 1, "y": 3}
    # the low-level client's key -> sample mapping covers keys that started tag-only
    client = tq.get_client()
    tq.kv_put(key="late", partition_id=pid, tag={"status": "pending"})
    bm = client.kv_retrieve_meta(["late", "tagged"], partition_id=pid)
    assert bm.size == 2 and bm.custom_meta == [{"status": "pending"}, {"status": "pending", "n": 0}]
    assert client.kv_retrieve_keys(bm.global_indexes, partition_id=pid) == ["late", "tagged"]


def test_kv_clear_deletes_the_samples_of_cleared_keys(tq: Any, dock: dockd.Dock, pid: str) -> None:
    uid = _uid()
    _register(tq, pid, [uid], 0)  # a prompt key keeps the partition alive, as in a real run
    keys = _finish(tq, pid, uid, sessions=4)
    before = _data_partition(dock, pid)
    assert before["columns"]["input_ids"] == 4 and before["deleted"] == 0
    tq.kv_clear(keys=keys[:3], partition_id=pid)
    after = _data_partition(dock, pid)
    assert after["columns"]["input_ids"] == 1 and after["deleted"] == 3  # freed now, not at the end
    assert sorted(tq.kv_list(pid)[pid]) == sorted([uid, keys[3]])
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys=keys[:1], partition_id=pid)
    # the last keys go: the whole data partition is freed
    tq.kv_clear(keys=[uid, keys[3]], partition_id=pid)
    assert tq.kv_list(pid) == {pid: {}}
    assert not [p for p in dock.stats()["partitions"] if p.startswith(f"tq/{pid}/")]


def test_checkpoint_keeps_tag_only_keys_and_cleared_keys_stay_gone(tq: Any, pid: str, tmp_path: Path) -> None:
    uid, keys = _group(tq, pid, 2, sessions=3)
    tq.kv_put(key=uid, partition_id=pid, tag={"status": "finished"})
    pending = _uid()
    _register(tq, pid, [pending], 5)
    tq.kv_clear(keys=[keys[0]], partition_id=pid)
    path = tmp_path / "tq"
    tq.save_checkpoint(str(path))
    tq.kv_clear(keys=list(tq.kv_list(pid)[pid]), partition_id=pid)
    tq.load_checkpoint(str(path))
    listed = tq.kv_list(pid)[pid]
    assert listed[pending] == {"is_prompt": True, "status": "pending", "global_steps": 5}
    assert listed[uid]["status"] == "finished" and sorted(listed) == sorted([uid, pending, *keys[1:]])
    got = tq.kv_batch_get(keys=keys[2:0:-1], partition_id=pid, select_fields="input_ids")
    assert torch.equal(got["input_ids"], torch.tensor([[8, 9, 10, 11], [4, 5, 6, 7]]))


# -- verl's ReplayBuffer ---------------------------------------------------------------------
def test_metadata_sync_classifies_prompts_and_trajectories(tq: Any, rbmod: Any, pid: str) -> None:
    pending, running, done, failed = (_uid() for _ in range(4))
    _register(tq, pid, [pending, running, done, failed], 1)
    tq.kv_put(key=running, partition_id=pid, tag={"status": "running"})
    done_keys = _finish(tq, pid, done)
    _finish(tq, pid, failed, sessions=0, status="failure")
    rb = _rb(rbmod)
    rb._sync_metadata_from_transfer_queue()
    assert rb.pending_keys[pid] == {pending} and rb.running_keys[pid] == {running}
    assert rb.finished_keys[pid] == {done} and rb.failure_keys[pid] == {failed}
    assert rb.prompt_global_steps[pid] == {pending: 1, running: 1, done: 1, failed: 1}
    assert set(rb.partitions[pid]) == set(done_keys)  # trajectories, with their tags
    assert rb.partitions[pid][done_keys[0]] == {"is_prompt": False, "global_steps": 0}
    bogus = _uid()
    tq.kv_put(key=bogus, partition_id=pid, tag={"is_prompt": True, "status": "bogus", "global_steps": 0})
    try:
        with pytest.raises(ValueError, match="Unknown status"):
            rb._sync_metadata_from_transfer_queue()
    finally:  # the buffer reads every partition: leave no such key for the other tests
        tq.kv_clear(keys=[bogus], partition_id=pid)


def test_sample_takes_oldest_terminal_groups_and_clears_their_prompts(
    tq: Any, rbmod: Any, dock: dockd.Dock, pid: str
) -> None:
    new_uid, _ = _group(tq, pid, 7)
    old_uid, old_keys = _group(tq, pid, 2)
    mid_uid, mid_keys = _group(tq, pid, 4, sessions=3)
    failed_uid, _ = _group(tq, pid, 1, sessions=0, status="failure")
    inflight = _uid()
    _register(tq, pid, [inflight], 0)
    rb = _rb(rbmod)
    batch, metrics = rb.sample(global_steps=8, partition_id=pid, batch_size=3)
    assert metrics == {}
    # oldest first: the failed group (no trajectories: sync mode keeps it, padded downstream), then
    # steps 2 and 4; the batch names the trajectories of the groups taken
    assert batch.partition_id == pid and sorted(batch.keys) == sorted(old_keys + mid_keys)
    assert all(tag == {"is_prompt": False, "global_steps": 0} for tag in batch.tags)
    listed = tq.kv_list(pid)[pid]
    assert failed_uid not in listed and old_uid not in listed and mid_uid not in listed  # prompts cleared
    assert new_uid in listed and inflight in listed and all(k in listed for k in batch.keys)
    data = tq.kv_batch_get_by_meta(batch, select_fields=["input_ids"])
    assert tuple(data["input_ids"].shape) == (5, 4)
    # the trainer clears the trajectories after its step
    tq.kv_clear(keys=batch.keys, partition_id=pid)
    assert _data_partition(dock, pid)["columns"]["input_ids"] == 2  # what new_uid's group holds


def test_sample_blocks_until_enough_groups_finish(tq: Any, rbmod: Any, pid: str) -> None:
    first, _ = _group(tq, pid, 0)
    second = _uid()
    _register(tq, pid, [second], 0)
    thread, out = _sample_in_thread(_rb(rbmod), pid, 2, 0)
    time.sleep(0.3)
    assert thread.is_alive() and not out  # one terminal group, two wanted
    keys = _finish(tq, pid, second)  # another process's agent loop would do exactly this
    thread.join(10)
    assert not thread.is_alive() and "error" not in out
    assert {k.split("_")[0] for k in out["batch"].keys} == {first, second} and set(keys) <= set(out["batch"].keys)


def test_groups_written_by_another_process(tq: Any, rbmod: Any, pid: str, dock_cluster: dockd.LocalCluster,
                                           run_python: Any) -> None:
    """The agent loop runs in other processes (Ray actors): their tag-only prompt keys, tag updates
    and trajectories reach the trainer's replay buffer."""
    uids = [_uid(), _uid()]
    run_python(f"""
        import torch
        from tensordict import TensorDict
        from dockd.trainer_plugins.verl import use_dockd_transfer_queue
        use_dockd_transfer_queue({dock_cluster.address!r})
        import transfer_queue as tq
        tq.init()
        pid, uids = {pid!r}, {uids!r}
        tq.kv_batch_put(keys=uids, partition_id=pid,
                        tags=[{{"is_prompt": True, "status": "pending", "global_steps": 3}} for _ in uids])
        for n, uid in enumerate(uids):
            tq.kv_put(key=uid, partition_id=pid, tag={{"status": "running"}})
            keys = [f"{{uid}}_{{s}}_0" for s in range(2)]
            tq.kv_batch_put(keys=keys, partition_id=pid,
                            fields=TensorDict({{"input_ids": torch.full((2, 3), n)}}, batch_size=2),
                            tags=[{{"is_prompt": False}}] * 2)
            tq.kv_put(key=uid, partition_id=pid, tag={{"status": "finished"}})
        tq.close()
    """)
    batch, _ = _rb(rbmod).sample(global_steps=3, partition_id=pid, batch_size=2)
    assert sorted(batch.keys) == sorted(f"{u}_{s}_0" for u in uids for s in range(2))
    got = tq.kv_batch_get(keys=sorted(batch.keys), partition_id=pid, select_fields="input_ids")["input_ids"]
    want = sorted((f"{u}_{s}_0", n) for n, u in enumerate(uids) for s in range(2))
    assert [int(row[0]) for row in got] == [n for _, n in want]


def test_sync_dapo_evicts_uniform_groups_and_refills_twice_as_many(
    tq: Any, rbmod: Any, dock: dockd.Dock, pid: str
) -> None:
    uniform, uniform_keys = _group(tq, pid, 1, rewards=[1.0, 1.0])
    varied, _ = _group(tq, pid, 1, rewards=[0.0, 1.0])
    refill = _Refill(tq, pid, 1, rewards=[0.0, 1.0])
    rb = _rb(rbmod, filter_groups_metric="acc", refill_fn=refill, max_inflight_gen_batches=2)
    batch, metrics = rb.sample(global_steps=1, partition_id=pid, batch_size=2)
    assert refill.calls == [2]  # sync DAPO refills 2k for k filtered groups
    assert metrics["training/filter_groups/evicted_samples"] == 1
    assert metrics["_dapo_filtered_reward_counts"] == {1.0: 1}
    assert metrics["training/filter_groups/discarded_surplus_samples"] == 1  # 3 sampleable, 2 taken
    picked = {k.split("_")[0] for k in batch.keys}
    assert len(picked) == 2 and picked <= {varied, *refill.uids}
    listed = tq.kv_list(pid)[pid]
    assert uniform not in listed and not set(uniform_keys) & set(listed)  # evicted: prompt and trajectories
    # everything but the batch's trajectories was cleared, and their samples deleted
    assert set(listed) == set(batch.keys)
    assert _data_partition(dock, pid)["columns"]["input_ids"] == 4


def test_async_dapo_on_canonical_reward_refills_exactly(tq: Any, rbmod: Any, pid: str) -> None:
    uniform, _ = _group(tq, pid, 1, rewards=[0.5, 0.5], canonical=True)
    good, _ = _group(tq, pid, 1, rewards=[0.0, 1.0], canonical=True)
    refill_uids: list[str] = []

    def refill(n: int) -> int:
        for _ in range(n):
            refill_uids.append(_group(tq, pid, 1, rewards=[1.0, 0.0], canonical=True)[0])
        return n

    rb = _rb(rbmod, mode="separate_async", filter_groups_metric="reward", refill_fn=refill)
    assert rb.get_sampleable_count(global_steps=1, partition_id=pid) == 1
    batch, metrics = rb.sample(global_steps=1, partition_id=pid, batch_size=2)
    assert len(refill_uids) == 1 and metrics["training/filter_groups/evicted_samples"] == 1
    assert {k.split("_")[0] for k in batch.keys} == {good, refill_uids[0]}
    assert uniform not in tq.kv_list(pid)[pid]


def test_async_drop_evicts_stale_groups_and_refills(tq: Any, rbmod: Any, pid: str) -> None:
    stale, stale_keys = _group(tq, pid, 1)
    fresh, _ = _group(tq, pid, 9)
    refill = _Refill(tq, pid, 10)
    rb = _rb(rbmod, mode="separate_async", max_off_policy_threshold=3, max_off_policy_strategy="drop",
             refill_fn=refill)
    batch, metrics = rb.sample(global_steps=10, partition_id=pid, batch_size=2)
    assert refill.calls == [1]
    assert metrics["training/off_policy/evicted_samples"] == 1
    assert metrics["training/off_policy/evicted_samples_staleness/max"] == 10  # 10 - 1 + 1 versions
    assert {k.split("_")[0] for k in batch.keys} == {fresh, refill.uids[0]}
    listed = tq.kv_list(pid)[pid]
    assert stale not in listed and not set(stale_keys) & set(listed)


def test_async_wait_blocks_while_a_stale_prompt_is_in_flight(tq: Any, rbmod: Any, pid: str) -> None:
    ready = [_group(tq, pid, 6)[0] for _ in range(2)]
    late = _uid()
    _register(tq, pid, [late], 4)
    tq.kv_put(key=late, partition_id=pid, tag={"status": "running"})
    rb = _rb(rbmod, mode="separate_async", max_off_policy_threshold=3, max_off_policy_strategy="wait")
    thread, out = _sample_in_thread(rb, pid, 2, 6)  # late spans 6 - 4 + 1 = 3 versions: wait for it
    time.sleep(0.3)
    assert thread.is_alive() and not out
    _finish(tq, pid, late)
    thread.join(10)
    assert not thread.is_alive() and "error" not in out and out["metrics"] == {}
    picked = {k.split("_")[0] for k in out["batch"].keys}
    assert late in picked and len(picked) == 2 and picked <= {late, *ready}  # the oldest goes first
    assert tq.kv_list(pid)[pid].keys() & set(ready)  # the one not taken is still there


def test_sync_refills_failed_groups_that_have_no_trajectories(tq: Any, rbmod: Any, pid: str) -> None:
    failed, _ = _group(tq, pid, 0, sessions=0, status="failure")
    partial, partial_keys = _group(tq, pid, 0, sessions=1, status="failure")  # kept: it has trajectories
    refill = _Refill(tq, pid, 0)
    rb = _rb(rbmod, sync_refill_failed_groups=True, refill_fn=refill)
    batch, metrics = rb.sample(global_steps=0, partition_id=pid, batch_size=2)
    assert refill.calls == [1] and metrics["training/rollout_failure/evicted_samples"] == 1
    assert {k.split("_")[0] for k in batch.keys} == {partial, refill.uids[0]}
    assert set(partial_keys) <= set(batch.keys) and failed not in tq.kv_list(pid)[pid]
    # without the refill, a batch of failures only is refused (nothing to train on)
    only_failed, _ = _group(tq, pid, 0, sessions=0, status="failure")
    with pytest.raises(RuntimeError, match="no materializable trajectories"):
        _rb(rbmod).sample(global_steps=0, partition_id=pid, batch_size=1)
    assert only_failed in tq.kv_list(pid)[pid]  # refused before anything was cleared


def test_validation_partition_takes_every_terminal_group(tq: Any, rbmod: Any) -> None:
    pid = "val"
    _empty(tq, pid)
    uniform, _ = _group(tq, pid, 0, rewards=[1.0, 1.0])
    stale, _ = _group(tq, pid, 0)
    rb = _rb(rbmod, mode="separate_async", filter_groups_metric="acc", refill_fn=_Refill(tq, pid, 0),
             max_off_policy_threshold=1)
    batch, metrics = rb.sample(global_steps=50, partition_id=pid, batch_size=2)
    assert metrics == {} and {k.split("_")[0] for k in batch.keys} == {uniform, stale}
    _empty(tq, pid)
