"""verl 0.9 plugin against real DataProto objects, real daemons and a real RayWorkerGroup on CPU."""

from __future__ import annotations

import json
import os
import pickle
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

import dockd

pytest.importorskip("verl.protocol")
from tensordict import NonTensorStack, TensorDict  # noqa: E402
from verl import DataProto  # noqa: E402

from dockd.trainer_plugins import verl as plugin  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # Ray's local cluster leaves /dev/null handles and Popen objects to the garbage collector,
    # which reports them in whichever test runs next
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

MAKE_DATA = r"""
import numpy as np, torch
from verl import DataProto

def make_data(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    uid = np.array([f"uid-{seed}-{i // 2}" for i in range(n)], dtype=object)
    raw_prompt_ids = np.empty(n, dtype=object)
    for i in range(n):
        raw_prompt_ids[i] = list(range(i + 1))          # ragged python lists
    extra = np.empty(n, dtype=object)
    for i in range(n):
        extra[i] = {"score": float(i) / 3, "tags": ("a", i), "arr": np.arange(i, dtype=np.int16)}
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 32000, (n, 10), generator=g),
            "attention_mask": torch.randint(0, 2, (n, 10), generator=g),
            "old_log_probs": torch.randn(n, 7, generator=g).to(torch.bfloat16),
            "values": torch.randn(n, 7, generator=g, dtype=torch.float64),
            "mask": torch.rand(n, 7, generator=g) > 0.5,
        },
        non_tensors={
            "uid": uid,
            "raw_prompt_ids": raw_prompt_ids,
            "extra": extra,
            "data_source": np.array(["gsm8k"] * n, dtype=object),
            "int_col": np.arange(n, dtype=np.int32),
        },
        meta_info={"global_steps": seed, "temperature": 0.7, "eos_token_id": [2, 3], "validate": False},
    )
"""
_ns: dict[str, Any] = {}
exec(MAKE_DATA, _ns)
make_data = _ns["make_data"]
BATCH_KEYS = ("input_ids", "attention_mask", "old_log_probs", "values", "mask")
NT_KEYS = ("uid", "raw_prompt_ids", "extra", "data_source", "int_col")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and all(_same(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def assert_same_data(got: DataProto, want: DataProto) -> None:
    assert got.batch.batch_size == want.batch.batch_size
    assert set(got.batch.keys()) == set(want.batch.keys())
    for k in want.batch.keys():  # noqa: SIM118 - iterating a TensorDict walks its rows, not its keys
        assert _same(got.batch[k], want.batch[k]), f"batch[{k!r}] differs"
    assert got.non_tensor_batch.keys() == want.non_tensor_batch.keys()
    for k in want.non_tensor_batch:
        assert _same(got.non_tensor_batch[k], want.non_tensor_batch[k]), f"non_tensor_batch[{k!r}] differs"
    assert _same(got.meta_info, want.meta_info)


def test_missing_verl_names_the_extra(dock: dockd.Dock) -> None:
    batch = dockd.Batch("p", [0], {"x": [torch.zeros(1)], plugin.META_COLUMN: [torch.zeros(1, dtype=torch.uint8)]})
    with (mock.patch.dict(sys.modules, {"verl.protocol": None}),
          pytest.raises(ImportError, match=r"pip install -e '\.\[verl\]'")):
        plugin.batch_to_data_proto(batch, batch_keys=["x"])


def test_data_proto_round_trip_bit_exact(dock: dockd.Dock) -> None:
    data = make_data(1)
    idx = plugin.put_data_proto(dock, data, partition="verl-rt", group_size=2)
    assert idx == list(range(6))
    back = plugin.get_data_proto(
        dock,
        consumer="trainer",
        count=6,
        partition="verl-rt",
        batch_keys=BATCH_KEYS,
        non_tensor_batch_keys=NT_KEYS,
        timeout=5.0,
    )
    assert_same_data(back, data)
    # a subset of keys, whole groups only, for another consumer
    sub = plugin.get_data_proto(
        dock,
        consumer="ref",
        count=4,
        partition="verl-rt",
        batch_keys=["input_ids"],
        non_tensor_batch_keys=["uid"],
        groups=True,
        timeout=5.0,
    )
    assert list(sub.non_tensor_batch["uid"]) == ["uid-1-0", "uid-1-0", "uid-1-1", "uid-1-1"]
    assert torch.equal(sub.batch["input_ids"], data.batch["input_ids"][:4])
    dock.clear("verl-rt")


def test_object_arrays_of_arrays_stay_object_arrays(dock: dockd.Dock) -> None:
    """Regression: an object array holding equal-shape numpy arrays came back as an int64[4, 2]."""
    n = 4
    pairs = np.empty(n, dtype=object)
    for i in range(n):
        pairs[i] = np.array([i, 10 * i], dtype=np.int64)
    scalars = np.empty(n, dtype=object)  # numpy scalars inside an object array stay elements too
    for i in range(n):
        scalars[i] = np.float32(i) / 2
    grid = np.empty((n, 2), dtype=object)  # a 2-D object array keeps its shape
    for i in range(n):
        grid[i, 0], grid[i, 1] = f"q{i}", [i]
    nested = np.empty(n, dtype=object)  # object arrays inside an object array
    for i in range(n):
        nested[i] = np.array([f"a{i}", None], dtype=object)
    data = DataProto.from_dict(
        tensors={"x": torch.arange(n)},
        non_tensors={
            "pairs": pairs,
            "scalars": scalars,
            "grid": grid,
            "nested": nested,
            "numeric2d": np.arange(2 * n, dtype=np.int64).reshape(n, 2),  # rows of a numeric array: stacked
            "numeric1d": np.arange(n, dtype=np.int32),
        },
    )
    keys = ("pairs", "scalars", "grid", "nested", "numeric2d", "numeric1d")
    plugin.put_data_proto(dock, data, partition="verl-objarr")
    back = plugin.get_data_proto(
        dock, consumer="t", count=n, partition="verl-objarr", batch_keys=["x"], non_tensor_batch_keys=keys, timeout=5.0
    )
    got = back.non_tensor_batch
    assert got["pairs"].dtype == object and got["pairs"].shape == (n,)
    for i in range(n):
        assert isinstance(got["pairs"][i], np.ndarray) and got["pairs"][i].dtype == np.int64
        assert got["pairs"][i].tolist() == [i, 10 * i]
    assert got["numeric2d"].dtype == np.int64 and got["numeric2d"].shape == (n, 2)
    assert_same_data(back, data)
    dock.clear("verl-objarr")


def test_put_from_another_process_get_here(dock_cluster: dockd.LocalCluster, dock: dockd.Dock, run_python: Any) -> None:
    run_python(
        MAKE_DATA
        + f"""
import dockd
from dockd.trainer_plugins.verl import put_data_proto
with dockd.connect({dock_cluster.address!r}) as dock:
    put_data_proto(dock, make_data(7), partition="verl-xproc")
    put_data_proto(dock, make_data(8), partition="verl-xproc")
"""
    )
    back = plugin.get_data_proto(
        dock,
        consumer="trainer",
        count=12,
        partition="verl-xproc",
        batch_keys=BATCH_KEYS,
        non_tensor_batch_keys=NT_KEYS,
        timeout=10.0,
    )
    second = make_data(8)
    second.meta_info = make_data(7).meta_info  # two puts: the first put's meta_info wins on conflicts
    want = DataProto.concat([make_data(7), second])
    assert_same_data(back, want)
    dock.clear("verl-xproc")


def test_outputs_written_back_to_the_same_samples(dock: dockd.Dock) -> None:
    data = make_data(3)
    plugin.put_data_proto(dock, data, partition="verl-wb")
    got, idx = plugin.get_data_proto_with_indexes(
        dock, consumer="actor", count=6, partition="verl-wb", batch_keys=["values"], timeout=5.0
    )
    out = DataProto.from_dict(tensors={"old_log_probs_v2": got.batch["values"] * 2})
    plugin.put_data_proto(dock, out, partition="verl-wb", indexes=idx, with_meta_info=False)
    merged = plugin.get_data_proto(
        dock, consumer="trainer", count=6, partition="verl-wb", batch_keys=["values", "old_log_probs_v2"], timeout=5.0
    )
    assert torch.equal(merged.batch["old_log_probs_v2"], data.batch["values"] * 2)
    dock.clear("verl-wb")


def _no_tensor_per_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, building a field from a tensor per value fails the test."""
    def per_value(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the get built a field from a tensor per value")

    monkeypatch.setattr(torch.nested, "nested_tensor", per_value)
    monkeypatch.setattr(torch, "stack", per_value)


def test_data_proto_ragged_fields_go_whole_and_come_back_from_the_buffers(
    dock: dockd.Dock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A jagged batch field is put as the nested tensor it is (one ragged run) and got back from the
    received buffer (no tensor per value), on the plain get and on a DOCK_DISPATCH worker's shard; bit-exact,
    bf16, a trailing shape, empty rows; a ragged column whose samples in one batch share a length comes back
    [n, length, ...] as before."""
    rows = [torch.randn(n, 2).to(torch.bfloat16) for n in (3, 0, 5, 1)] + [torch.randn(2, 2).to(torch.bfloat16)] * 2
    data = DataProto.from_dict(tensors={"resp": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
                                        "ids": torch.arange(12).view(6, 2)})
    given: list[Any] = []
    real_put = dockd.Dock.put

    def spy(self: Any, columns: Any, **kw: Any) -> Any:
        given.append(columns["resp"])
        return real_put(self, columns, **kw)

    monkeypatch.setattr(dockd.Dock, "put", spy)
    plugin.put_data_proto(dock, data, partition="verl-jag")
    assert isinstance(given[0], torch.Tensor) and given[0].layout == torch.jagged  # not a list per sample
    tail = torch.stack(rows[4:])
    _no_tensor_per_value(monkeypatch)
    got = plugin.get_data_proto(dock, consumer="t", count=4, partition="verl-jag", batch_keys=["resp", "ids"],
                                timeout=5.0)
    assert got.batch["resp"].layout == torch.jagged
    assert all(_same(a, b) for a, b in zip(got.batch["resp"].unbind(0), rows[:4]))
    assert _same(got.batch["ids"], data.batch["ids"][:4])
    # the last two (both of length 2) through a worker's shard: one [2, 2, 2] tensor, as torch.stack made it
    lease = dock.acquire("t", plugin.data_proto_columns(["resp"], ()), 2, partition="verl-jag", inline=False)
    locations, _ = plugin.dispatch.metadata_only(dock, lease)
    shard = plugin.DockShard(request=plugin.DockRequest(address="-", partition="verl-jag", consumer="t", count=2,
                                                        batch_keys=("resp",)),
                             rank=0, count=2, indexes=tuple(lease.indexes),
                             locations=tuple(tuple(int(w) for w in row) for row in locations))
    part, idx = plugin.dispatch._fetch_slice(dock, shard)
    assert idx == [4, 5] and _same(part.batch["resp"], tail)
    dock.confirm(lease)
    dock.clear("verl-jag")


def test_dispatch_splits_counts_and_validates() -> None:
    assert plugin.shard_counts(10, 3) == [4, 3, 3]
    assert plugin.shard_counts(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="count must be > 0"):
        plugin.DockRequest(address="a:1", partition="p", consumer="c", count=0, batch_keys=("x",))
    with pytest.raises(ValueError, match="assign"):
        plugin.DockRequest(address="a:1", partition="p", consumer="c", count=1, batch_keys=("x",), assign="x")
    mode = plugin.dock_dispatch_mode()
    from verl.single_controller.base.decorator import Dispatch, get_predefined_dispatch_fn

    assert mode is Dispatch.DOCKD_SHARD and plugin.dock_dispatch_mode() is mode
    assert get_predefined_dispatch_fn(mode)["dispatch_fn"] is plugin.dispatch_dock_shards


def test_driver_sends_indexes_and_locations_only(dock_cluster: dockd.LocalCluster, dock: dockd.Dock) -> None:
    data = make_data(5, n=8)
    plugin.put_data_proto(dock, data, partition="verl-meta", group_size=2)
    req = plugin.DockRequest(
        address=dock_cluster.address,
        partition="verl-meta",
        consumer="meta",
        count=8,
        batch_keys=("input_ids", "old_log_probs"),
        non_tensor_batch_keys=("uid",),
        groups=True,
    )
    shards = plugin.dispatch._driver_shards(req, 3)
    # whole groups per worker (4 groups over 3 workers), metadata only: no inline payload
    assert [s.indexes for s in shards] == [(0, 1, 2, 3), (4, 5), (6, 7)]
    assert all(s.inline == b"" and s.locations is not None for s in shards)
    assert all(w >= 0 for s in shards for row in s.locations for w in row)  # type: ignore[union-attr]
    for shard in shards:  # what each worker does, from its own connection
        with dockd.connect(dock_cluster.address) as worker:
            got, idx = plugin.dispatch._fetch_slice(worker, shard)
        rows = list(idx)
        assert torch.equal(got.batch["input_ids"], data.batch["input_ids"][rows])
        assert torch.equal(got.batch["old_log_probs"], data.batch["old_log_probs"][rows])
        assert list(got.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"][rows])
    results = [plugin.DockResult(partition="verl-meta", indexes=list(s.indexes), lease_id=s.lease_id) for s in shards]
    merged = plugin.collect_dock_results(None, results)
    assert merged.indexes == list(range(8)) and merged.per_worker == (4, 2, 2)
    with pytest.raises(dockd.DockTimeout):  # the driver's lease was confirmed: nothing left for "meta"
        dock.get("meta", ["input_ids"], 1, partition="verl-meta", timeout=0.3)
    dock.clear("verl-meta")


# -- a real verl worker group: two CPU workers fetching their shards from dockd ------------------
@pytest.fixture(scope="module")
def ray_session() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    with mock.patch.dict(os.environ, {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
        ray.shutdown()


def _make_worker_cls() -> type:
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import register

    class ScoreWorker(Worker):
        @register(dispatch_mode=plugin.DOCK_DISPATCH)
        @plugin.dock_io
        def score(self, data: DataProto) -> DataProto:
            scores = data.batch["input_ids"].float().sum(-1)
            who = np.array([f"rank{self.rank}"] * len(data), dtype=object)
            return DataProto.from_dict(tensors={"scores": scores}, non_tensors={"who": who})

    return ScoreWorker


def test_worker_group_fetches_its_own_shards(
    ray_session: Any, dock_cluster: dockd.LocalCluster, dock: dockd.Dock
) -> None:
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    data = make_data(21, n=12)  # 12 samples, groups of 2
    plugin.put_data_proto(dock, data, partition="verl-wg", group_size=2)
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray_session.remote(_make_worker_cls()))
    )
    assert wg.world_size == 2
    # assign="driver": the driver acquires 8 samples (metadata) and sends each worker its index slice
    res = wg.score(
        plugin.DockRequest(
            address=dock_cluster.address,
            partition="verl-wg",
            consumer="reward",
            count=8,
            batch_keys=("input_ids",),
            groups=True,
        )
    )
    assert isinstance(res, plugin.DockResult)
    assert res.per_worker == (4, 4) and res.indexes == list(range(8))  # whole groups, in worker order
    assert set(res.output_keys) == {"scores", "who"}
    # the remaining samples: each worker acquires its own share
    res2 = wg.score(
        plugin.DockRequest(
            address=dock_cluster.address,
            partition="verl-wg",
            consumer="reward",
            count=4,
            batch_keys=("input_ids",),
            assign="workers",
        )
    )
    assert res2.per_worker == (2, 2) and sorted(res2.indexes) == [8, 9, 10, 11]
    stats = dock.stats()["partitions"]["verl-wg"]["consumers"]["reward"]
    assert stats["taken"] + stats["leased"] == 12  # confirms are one-way messages: some may be in flight
    with pytest.raises(dockd.DockTimeout):  # every sample went to exactly one worker
        dock.get("reward", ["input_ids"], 1, partition="verl-wg", timeout=0.3)
    # the workers' outputs landed on the samples they read
    back = plugin.get_data_proto(
        dock,
        consumer="trainer",
        count=12,
        partition="verl-wg",
        batch_keys=("input_ids", "scores"),
        non_tensor_batch_keys=("who",),
        timeout=5.0,
    )
    assert torch.equal(back.batch["scores"], data.batch["input_ids"].float().sum(-1))
    assert list(back.non_tensor_batch["who"][:8]) == ["rank0"] * 4 + ["rank1"] * 4
    assert sorted(back.non_tensor_batch["who"][8:]) == ["rank0", "rank0", "rank1", "rank1"]
    dock.clear("verl-wg")


# -- the transfer_queue switch ------------------------------------------------------------------
TQ_WRITER = r"""
import torch
from tensordict import NonTensorStack, TensorDict
from dockd.trainer_plugins.verl import use_dockd_transfer_queue
use_dockd_transfer_queue({address!r})
import transfer_queue as tq
tq.init()
keys = [f"uid-{{i}}" for i in range(6)]
fields = TensorDict(
    {{
        "prompts": torch.arange(24).view(6, 4),
        "old_log_prob": torch.linspace(-1, 0, 18).view(6, 3).to(torch.bfloat16),
        "raw_prompt": NonTensorStack.from_list([f"question {{i}} ✓" for i in range(6)]),
    }},
    batch_size=6,
)
meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=[{{"status": "running"}}] * 6)
assert meta.fields == ["old_log_prob", "prompts", "raw_prompt"], meta.fields
tq.kv_batch_put(keys=keys[:2], partition_id="train", tags=[{{"status": "success"}}] * 2)
tq.close()
"""


@pytest.fixture()
def dockd_tq(dock_cluster: dockd.LocalCluster) -> Iterator[Any]:
    from dockd.trainer_plugins.verl import transfer_queue as compat

    plugin.use_dockd_transfer_queue(dock_cluster.address)
    import transfer_queue as tq

    assert tq is compat
    tq.init()
    yield tq
    compat.uninstall()


def test_kv_list_answers_a_kept_read_only_view_changed_only_by_new_entries(dockd_tq: Any) -> None:
    tq, pid = dockd_tq, f"view-{uuid.uuid4().hex[:6]}"
    tq.kv_batch_put(keys=["a", "b"], partition_id=pid, tags=[{"status": "pending"}, {"status": "pending"}])
    first = tq.kv_list(pid)[pid]
    assert first == {"a": {"status": "pending"}, "b": {"status": "pending"}}
    assert tq.kv_list(pid)[pid] is first  # unchanged: the same view, not a copy per poll
    with pytest.raises(TypeError, match="read-only"):
        first["c"] = {}
    with pytest.raises(TypeError, match="read-only"):
        first["a"]["status"] = "running"
    tq.kv_put(key="a", partition_id=pid, tag={"status": "running", "step": 2})
    tq.kv_clear(keys=["b"], partition_id=pid)
    second = tq.kv_list(pid)[pid]
    assert second == {"a": {"status": "running", "step": 2}}
    assert first == {"a": {"status": "pending"}, "b": {"status": "pending"}}  # a held answer never changes
    back = pickle.loads(pickle.dumps(second))
    assert type(back) is dict and type(back["a"]) is dict and back == second
    assert tq.kv_list()[pid] is second


def test_transfer_queue_switch_across_processes(
    dockd_tq: Any, dock_cluster: dockd.LocalCluster, dock: dockd.Dock, run_python: Any
) -> None:
    tq = dockd_tq
    run_python(TQ_WRITER.format(address=dock_cluster.address))
    listed = tq.kv_list("train")["train"]
    assert listed["uid-0"] == {"status": "success"} and listed["uid-5"] == {"status": "running"}
    data = tq.kv_batch_get(keys=["uid-4", "uid-1"], partition_id="train")
    assert torch.equal(data["prompts"], torch.tensor([[16, 17, 18, 19], [4, 5, 6, 7]]))
    want = torch.linspace(-1, 0, 18).view(6, 3).to(torch.bfloat16)
    assert data["old_log_prob"].dtype == torch.bfloat16 and torch.equal(data["old_log_prob"], want[[4, 1]])
    assert data["raw_prompt"] == ["question 4 ✓", "question 1 ✓"]
    # a later stage adds a field to existing keys (as verl writes ref_log_prob next to responses)
    tq.kv_batch_put(
        keys=["uid-0", "uid-1"],
        partition_id="train",
        fields=TensorDict({"ref_log_prob": torch.tensor([[0.5], [0.25]])}, batch_size=2),
    )
    sel = tq.kv_batch_get(keys=["uid-1", "uid-0"], partition_id="train", select_fields="ref_log_prob")
    assert list(sel.keys()) == ["ref_log_prob"] and torch.equal(sel["ref_log_prob"], torch.tensor([[0.25], [0.5]]))
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys=["nope"], partition_id="train")
    with pytest.raises(ValueError, match="no fields"):
        tq.kv_batch_get(keys=["uid-2"], partition_id="train", select_fields=["ref_log_prob"])
    # clearing every key frees the data partition; the next put starts a new generation
    tq.kv_clear(keys=[f"uid-{i}" for i in range(6)], partition_id="train")
    assert tq.kv_list("train") == {"train": {}}
    assert "tq/train/g0" not in dock.stats()["partitions"]
    tq.kv_put(key="again", partition_id="train", fields={"x": torch.tensor([1, 2, 3])}, tag={"s": 1})
    assert torch.equal(tq.kv_batch_get(keys="again", partition_id="train")["x"], torch.tensor([[1, 2, 3]]))
    assert "tq/train/g1" in dock.stats()["partitions"]


def test_transfer_queue_ragged_fields_and_data_parser(dockd_tq: Any) -> None:
    tq = dockd_tq
    nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(5)], layout=torch.jagged)
    tq.kv_batch_put(keys=["a", "b"], partition_id="ragged", fields=TensorDict({"r": nested}, batch_size=2))
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="ragged")["r"]
    assert [t.tolist() for t in got.unbind(0)] == [[0, 1], [0, 1, 2, 3, 4]]
    seen: dict[str, Any] = {}

    def parser(d: dict[str, Any]) -> None:  # TransferQueue's contract: a plain dict, edited in place
        seen.update({k: type(v).__name__ for k, v in d.items()})
        d["url"] = [f"fetched:{u}" for u in d["url"]]
        d["r"] = [t * 10 for t in d["r"]]

    fields = TensorDict(
        {
            "r": torch.nested.nested_tensor([torch.arange(3), torch.arange(1)], layout=torch.jagged),
            "x": torch.ones(2, 2),
            "url": NonTensorStack("s3://a", "s3://b"),
        },
        batch_size=2,
    )
    tq.kv_batch_put(keys=["c", "d"], partition_id="parsed", fields=fields, data_parser=parser)
    assert seen == {"r": "list", "x": "Tensor", "url": "list"}
    back = tq.kv_batch_get(keys=["c", "d"], partition_id="parsed")
    assert back["url"] == ["fetched:s3://a", "fetched:s3://b"]
    assert [t.tolist() for t in back["r"].unbind(0)] == [[0, 10, 20], [0]]
    with pytest.raises(ValueError, match="keep the fields"):
        tq.kv_put(key="e", partition_id="parsed", fields={"x": torch.ones(2)}, data_parser=lambda d: {})


def test_transfer_queue_passes_jagged_fields_to_the_dock_whole(dockd_tq: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A jagged field goes to the dock as the nested tensor it is (one values buffer, one ragged run), not
    unbound into a tensor per sample."""
    tq = dockd_tq
    given: list[Any] = []
    real_put = dockd.Dock.put

    def spy(self: Any, columns: Any, **kw: Any) -> Any:
        given.extend(v for k, v in columns.items() if k == "r")
        return real_put(self, columns, **kw)

    monkeypatch.setattr(dockd.Dock, "put", spy)
    rows = [torch.arange(n, dtype=torch.bfloat16) for n in (4, 0, 2)]
    tq.kv_batch_put(keys=["j0", "j1", "j2"], partition_id="jagged",
                    fields=TensorDict({"r": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=3))
    assert len(given) == 1 and isinstance(given[0], torch.Tensor) and given[0].layout == torch.jagged

    def per_value(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the get built the field from a tensor per value")

    monkeypatch.setattr(torch.nested, "nested_tensor", per_value)  # (from the received buffer: Batch.jagged)
    monkeypatch.setattr(torch, "stack", per_value)
    got = tq.kv_batch_get(keys=["j2", "j0", "j1"], partition_id="jagged")["r"]
    assert got.layout == torch.jagged and all(torch.equal(a, b) for a, b in zip(got.unbind(0), rows[2:] + rows[:2]))


def test_transfer_queue_batch_meta_is_strict(dockd_tq: Any) -> None:
    tq = dockd_tq
    with pytest.raises(TypeError, match="global_indexes"):
        tq.BatchMeta()  # TransferQueue's BatchMeta needs them too; no silent placeholder
    empty = tq.BatchMeta.empty(extra_info={"a": 1})
    assert empty.size == 0 and len(empty) == 0 and empty.extra_info == {"a": 1} and not empty.is_ready
    with pytest.raises(ValueError, match="Length mismatch"):
        tq.BatchMeta(global_indexes=[0, 1], partition_ids=["p"])


def test_tqbridge_runs_a_worker_method_on_dockd(dockd_tq: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's own tqbridge: KVBatchMeta in, data fetched through get_client, outputs written back."""
    tq = dockd_tq
    from verl.utils import transferqueue_utils as tqu

    # verl bound `transfer_queue` (and its classes) when it was first imported; point it at the switch
    monkeypatch.setattr(tqu, "tq", tq)
    monkeypatch.setattr(tqu, "BatchMeta", tq.BatchMeta)
    monkeypatch.setattr(tqu, "KVBatchMeta", tq.KVBatchMeta)
    keys = [f"k{i}" for i in range(4)]
    fields = TensorDict(
        {"responses": torch.arange(12).view(4, 3), "prompt": NonTensorStack(*[f"q{i}" for i in range(4)])},
        batch_size=4,
    )
    kv_meta = tq.kv_batch_put(keys=keys, partition_id="bridge", fields=fields, tags=[{"s": i} for i in range(4)])
    kv_meta.extra_info = {"temperature": 0.5}
    calls: list[Any] = []

    @tqu.tqbridge()
    def compute_score(data: TensorDict) -> TensorDict:
        calls.append(data)
        return TensorDict({"score": data["responses"].sum(-1).float()}, batch_size=data.batch_size)

    out = compute_score(kv_meta)
    assert isinstance(out, tq.KVBatchMeta) and out.keys == keys and out.partition_id == "bridge"
    assert out.tags == [{"s": i} for i in range(4)]
    got = calls[0]
    assert torch.equal(got["responses"], torch.arange(12).view(4, 3))
    assert got["prompt"] == [f"q{i}" for i in range(4)]
    score = tq.kv_batch_get(keys=["k2", "k0"], partition_id="bridge", select_fields="score")["score"]
    assert torch.equal(score, torch.tensor([21.0, 3.0]))
    # the conversions themselves, and the low-level calls verl makes
    meta = tqu.kv_batch_meta2batch_meta(tq.KVBatchMeta(keys=["k1"], tags=[{}], partition_id="bridge",
                                                       fields=["score"]))
    assert isinstance(meta, tq.BatchMeta) and meta.field_names == ["score"] and meta.size == 1
    client = tq.get_client()
    assert client.kv_retrieve_keys(meta.global_indexes, partition_id="bridge") == ["k1"]
    assert torch.equal(client.get_data(meta)["score"], torch.tensor([12.0]))
    created = client.kv_retrieve_meta(["new"], partition_id="bridge", create=True)
    assert created.size == 1 and not created.is_ready and "new" in tq.kv_list("bridge")["bridge"]
    put_meta = client.put(TensorDict({"score": torch.tensor([7.0])}, batch_size=1), metadata=created)
    assert put_meta.is_ready and tq.kv_batch_get(keys="new", partition_id="bridge")["score"].tolist() == [7.0]
    with pytest.raises(AttributeError, match="has no attribute 'no_such_call'"):
        client.no_such_call()


def test_transfer_queue_checkpoint_round_trip(dockd_tq: Any, tmp_path: Any) -> None:
    tq = dockd_tq
    want = torch.linspace(-1, 1, 12).view(4, 3).to(torch.bfloat16)
    fields = TensorDict({"lp": want, "p": NonTensorStack(*[f"p{i} ✓" for i in range(4)])}, batch_size=4)
    tq.kv_batch_put(keys=[f"c{i}" for i in range(4)], partition_id="ckpt", fields=fields,
                    tags=[{"status": "running"}] * 4)
    tq.kv_batch_put(keys=["c1"], partition_id="ckpt", tags=[{"status": "success"}])
    path = tmp_path / "transfer_queue"
    tq.save_checkpoint(str(path), metadata={"global_steps": 7})
    tq.save_checkpoint(str(path), metadata={"global_steps": 8})  # replaced atomically
    assert json.loads((path / "metadata.json").read_text())["user_metadata"] == {"global_steps": 8}
    assert not (tmp_path / "transfer_queue.tmp").exists() and not (tmp_path / "transfer_queue.old").exists()
    tq.kv_clear(keys=["c0", "c1", "c2", "c3"], partition_id="ckpt")
    tq.kv_put(key="later", partition_id="ckpt", fields={"lp": want[0]})
    assert list(tq.kv_list("ckpt")["ckpt"]) == ["later"]
    tq.load_checkpoint(str(path))
    listed = tq.kv_list("ckpt")["ckpt"]
    assert listed == {"c0": {"status": "running"}, "c1": {"status": "success"},
                      "c2": {"status": "running"}, "c3": {"status": "running"}}
    back = tq.kv_batch_get(keys=["c3", "c0"], partition_id="ckpt")
    assert back["lp"].dtype == torch.bfloat16 and torch.equal(back["lp"], want[[3, 0]])
    assert back["p"] == ["p3 ✓", "p0 ✓"]
    with pytest.raises(FileNotFoundError):
        tq.load_checkpoint(str(tmp_path / "missing"))
    # the client's controller/storage checkpoint calls save and restore the same whole checkpoint
    client = tq.get_client()
    client.initialize_storage_manager(manager_type="SimpleStorage", config={})
    client.save_controller_checkpoint(str(tmp_path / "controller"))
    tq.kv_clear(keys=["c0", "c1", "c2", "c3"], partition_id="ckpt")
    client.load_storage_checkpoint(str(tmp_path / "controller"))
    assert tq.kv_list("ckpt")["ckpt"]["c1"] == {"status": "success"}
    assert torch.equal(tq.kv_batch_get(keys=["c2"], partition_id="ckpt")["lp"], want[[2]])


def test_transfer_queue_metrics_endpoint(dockd_tq: Any, dock_cluster: dockd.LocalCluster,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tq = dockd_tq
    monkeypatch.delenv(tq.ENV_METRICS, raising=False)
    with pytest.raises(RuntimeError, match="--metrics-port"):
        tq.get_metrics_endpoint()
    tq.init({"dockd": {"address": dock_cluster.address, "metrics_endpoint": "10.0.0.1:7452"}})
    assert tq.get_metrics_endpoint() == "10.0.0.1:7452"


def test_transfer_queue_streaming_dataloader(dockd_tq: Any, dock_cluster: dockd.LocalCluster) -> None:
    tq = dockd_tq
    keys = [f"s{i}" for i in range(6)]
    fields = TensorDict({"x": torch.arange(12).view(6, 2), "q": NonTensorStack(*[f"q{i}" for i in range(6)])},
                        batch_size=6)
    tq.kv_batch_put(keys=keys, partition_id="stream", fields=fields)
    ds = tq.StreamingDataset(
        config={"dockd": {"address": dock_cluster.address}},
        batch_size=4,
        micro_batch_size=2,
        data_fields=["x", "q"],
        partition_id="stream",
        task_name="actor",
        dp_rank=0,
        should_check_consumption_status=True,
        poll_interval=0.2,
    )
    loader = tq.StreamingDataLoader(ds)
    got = list(loader)
    assert [td.batch_size[0] for td, _ in got] == [2, 2, 2]
    seen = [k for _, meta in got for k in meta.keys]
    assert sorted(seen) == keys
    for td, meta in got:
        assert isinstance(meta, tq.BatchMeta) and meta.field_names == ["q", "x"]
        for row, key in enumerate(meta.keys):
            i = int(key[1:])
            assert td["x"][row].tolist() == [2 * i, 2 * i + 1] and td["q"][row] == f"q{i}"
    assert len(loader.get_buffer()) == 2  # a batch of 4, then the last 2
    assert tq.get_client().check_consumption_status("actor", "stream")  # fetch_batch_fn: test_verl_tq_sampler.py
