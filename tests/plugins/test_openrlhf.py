"""DockReplayBuffer against OpenRLHF 0.11's real Experience, NaiveReplayBuffer and DataLoader pattern."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

import dockd

ppo_utils = pytest.importorskip("openrlhf.trainer.ppo_utils")
from openrlhf.trainer.ppo_utils import Experience, NaiveReplayBuffer  # noqa: E402

from dockd.trainer_plugins import openrlhf as plugin  # noqa: E402

# Builds deterministic batched Experiences with every field set; run in this process and in writers.
MAKE_EXPERIENCES = r"""
import torch
from openrlhf.trainer.ppo_utils import Experience

def make_experience(seed, batch=4):
    g = torch.Generator().manual_seed(seed)
    T, A = 12, 7
    lengths = torch.randint(6, T + 1, (batch,), generator=g)
    attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    sequences = torch.randint(3, 1000, (batch, T), generator=g) * attention_mask
    action_mask = torch.rand(batch, T, generator=g) > 0.3
    action_mask = action_mask & attention_mask.bool()
    def step(dtype=torch.float32):
        return (torch.randn(batch, T, generator=g) * attention_mask).to(dtype)
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=step(),
        base_action_log_probs=step(torch.bfloat16),
        rollout_log_probs=None,
        values=step(),
        returns=step(),
        advantages=step(),
        kl=step(torch.float16),
        rewards=torch.randn(batch, generator=g),
        scores=torch.randint(0, 2, (batch,), generator=g).float(),
        response_length=lengths.float(),
        truncated=torch.zeros(batch, dtype=torch.bool),
        total_length=lengths.float(),
        index=[seed * 100 + i for i in range(batch)],
        prompts=[f"prompt {seed}-{i} ✓" for i in range(batch)],
        labels=[f"label {seed}-{i}" for i in range(batch)],
        images=[None] * batch,
        info={
            "reward": torch.randn(batch, generator=g),
            "response_clip_ratio": torch.rand(batch, generator=g),
            "tags": [["a", seed, i] for i in range(batch)],
        },
    )
"""
_ns: dict[str, Any] = {}
exec(MAKE_EXPERIENCES, _ns)
make_experience = _ns["make_experience"]


@pytest.fixture()
def naive_buffer() -> Any:
    with mock.patch("torch.cuda.current_device", return_value=0):
        return NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=True, packing_samples=False)


@pytest.fixture()
def make_buffer(dock_cluster: dockd.LocalCluster) -> Any:
    """DockReplayBuffer(...) on the test cluster; every buffer made is closed at teardown."""
    made: list[plugin.DockReplayBuffer] = []

    def make(*args: Any, **kwargs: Any) -> plugin.DockReplayBuffer:
        kwargs.setdefault("address", dock_cluster.address)
        buf = plugin.DockReplayBuffer(*args, **kwargs)
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def assert_same_experience(got: Experience, want: Experience, skip: tuple[str, ...] = ("index",)) -> None:
    """Field-by-field, bit-exact. `index` is compared separately: NaiveReplayBuffer drops it."""
    for f in dataclasses.fields(Experience):
        if f.name in skip:
            continue
        g, w = getattr(got, f.name), getattr(want, f.name)
        assert _same(g, w), f"Experience.{f.name} differs: {g!r} vs {w!r}"


def test_import_does_not_import_openrlhf(run_python: Any) -> None:
    out = run_python(
        """
        import sys
        import dockd.trainer_plugins.openrlhf, dockd.trainer_plugins.verl, dockd.trainer_plugins.megatron_grpo
        frameworks = ('openrlhf', 'verl', 'megatron', 'tensordict', 'ray', 'transfer_queue')
        print(sorted(m for m in sys.modules if m.split('.')[0] in frameworks))
        """
    )
    assert out.strip() == "[]"


def test_missing_framework_names_the_extra() -> None:
    with (mock.patch.dict(sys.modules, {"openrlhf.trainer.ppo_utils.experience": None}),
          pytest.raises(ImportError, match=r"pip install -e '\.\[openrlhf\]'")):
        plugin.DockReplayBuffer(2, address="127.0.0.1:1")


def test_every_field_round_trips_like_naive_buffer(
    make_buffer: Any, dock_cluster: dockd.LocalCluster, naive_buffer: Any
) -> None:
    buf = make_buffer(2, name="rt", shard="s0")
    for seed in (1, 2):
        naive_buffer.append(make_experience(seed))
        buf.append(make_experience(seed))
    assert len(buf) == len(naive_buffer) == 8
    for got, want in zip(buf.items, naive_buffer.items):
        assert_same_experience(got, want)
    assert naive_buffer.items[0].index is None  # OpenRLHF's split drops it ...
    assert [e.index for e in buf.items] == [[100], [101], [102], [103], [200], [201], [202], [203]]  # ... we keep it
    # right padding was stripped per sample exactly as OpenRLHF does
    assert {int(e.sequences.shape[0]) for e in buf.items} != {12}


def test_append_puts_step_fields_as_jagged_columns_like_naive_buffer(
    make_buffer: Any, naive_buffer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step field goes to the dock as one jagged column (the rows' unpadded prefixes in one buffer),
    each episode field as one batched tensor, never a tensor per sample; what comes back is what
    NaiveReplayBuffer keeps, bit for bit: a row without padding, a row whose mask is all zeros (nothing
    stripped, as OpenRLHF does), bf16 and fp16 fields, a None field."""
    def experience() -> Experience:
        exp = make_experience(5, batch=5)
        exp.attention_mask[0] = 1
        exp.attention_mask[1] = 0
        return exp

    given: list[dict[str, Any]] = []
    real_put = dockd.Dock.put

    def spy(self: Any, columns: Any, **kw: Any) -> Any:
        given.append(dict(columns))
        return real_put(self, columns, **kw)

    monkeypatch.setattr(dockd.Dock, "put", spy)
    buf = make_buffer(2, name="jagged", shard="s0")
    naive_buffer.append(experience())
    assert buf.append(experience()) == [0, 1, 2, 3, 4]
    for f in dataclasses.fields(Experience):
        column = given[0].get(f"exp/{f.name}")
        if f.name == "rollout_log_probs":  # None: an empty value per sample, in one tensor
            assert isinstance(column, torch.Tensor) and column.shape == (5, 0)
        elif Experience.is_step_tensor_field(f.name):
            assert type(column) is dockd.Jagged, f"{f.name} was put as {type(column).__name__}"
        elif Experience.is_episode_tensor_field(f.name):
            assert isinstance(column, torch.Tensor) and column.shape == (5,), f.name
    assert len(buf) == 5
    for got, want in zip(buf.items, naive_buffer.items):
        assert_same_experience(got, want)
    assert [int(e.sequences.shape[0]) for e in buf.items][:2] == [12, 12]


def test_appended_in_another_process_read_here(
    make_buffer: Any, dock_cluster: dockd.LocalCluster, naive_buffer: Any, run_python: Any
) -> None:
    run_python(
        MAKE_EXPERIENCES
        + f"""
from dockd.trainer_plugins.openrlhf import DockReplayBuffer
buf = DockReplayBuffer(4, address={dock_cluster.address!r}, name="xproc", shard="rank0")
for seed in (11, 12, 13):
    buf.append(make_experience(seed))
buf.close()
"""
    )
    for seed in (11, 12, 13):
        naive_buffer.append(make_experience(seed))
    reader = make_buffer(4, name="xproc", shard="rank0")
    assert len(reader) == 12
    for got, want in zip(reader.items, naive_buffer.items):
        assert_same_experience(got, want)
    # a second reader with the same consumer gets nothing more; another consumer sees everything
    again = make_buffer(4, name="xproc", shard="rank0")
    assert len(again) == 0
    other = make_buffer(4, name="xproc", shard="rank0", consumer="critic")
    assert len(other) == 12


def test_openrlhf_dataloader_pattern_matches_naive(
    make_buffer: Any, dock_cluster: dockd.LocalCluster, naive_buffer: Any
) -> None:
    buf = make_buffer(2, name="dl", shard="s0")
    for seed in (21, 22):
        buf.append(make_experience(seed))
        naive_buffer.append(make_experience(seed))

    def batches(buffer: Any) -> list[Experience]:
        loader = DataLoader(
            buffer,
            batch_size=buffer.sample_batch_size,
            shuffle=False,
            drop_last=True,
            pin_memory=False,
            collate_fn=buffer.collate_fn,
        )
        return list(loader)

    got, want = batches(buf), batches(naive_buffer)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert isinstance(g, Experience)
        assert_same_experience(g, w)
    # shuffled epoch, as the actor trainer runs it: a permutation of the same samples
    loader = DataLoader(buf, batch_size=2, shuffle=True, drop_last=True, collate_fn=buf.collate_fn)
    seen = sorted(i for exp in loader for i in exp.index)
    assert seen == [2100, 2101, 2102, 2103, 2200, 2201, 2202, 2203]
    assert [exp.index for exp in got] == [[2100, 2101], [2102, 2103], [2200, 2201], [2202, 2203]]


def test_sample_clear_and_limit(make_buffer: Any, dock_cluster: dockd.LocalCluster, dock: dockd.Dock) -> None:
    buf = make_buffer(3, limit=5, name="lim", shard="s0")
    buf.append(make_experience(31))
    buf.append(make_experience(32))
    assert len(buf) == 5  # the oldest 3 dropped, as NaiveReplayBuffer does
    assert [e.index for e in buf.items] == [[3103], [3200], [3201], [3202], [3203]]
    exp = buf.sample()
    assert exp.sequences.shape[0] == 3 and exp.sequences.device.type == "cpu"
    partition = buf.partition
    assert partition == "lim/s0"
    assert dock.stats()["partitions"][partition]["deleted"] == 0
    buf.clear()
    assert len(buf) == 0 and buf.partition == partition
    # every sample the buffer pulled is deleted in the dock, those `limit` dropped included
    assert dock.stats()["partitions"][partition]["deleted"] == 8
    with pytest.raises(ValueError, match="needs 3 samples"):
        buf.sample()
    # append then clear without a read in between leaves nothing behind, as NaiveReplayBuffer
    buf.append(make_experience(33))
    buf.clear()
    assert len(buf) == 0
    assert dock.stats()["partitions"][partition]["deleted"] == 12


@pytest.mark.slow  # (CI runs it: make test-slow)
def test_buffers_sharing_a_name_keep_sharing_after_clear(
    make_buffer: Any, dock_cluster: dockd.LocalCluster, run_python: Any
) -> None:
    """Regression: each object kept its own generation, so after a reader's clear it read an
    empty partition while the writer kept appending to the old one."""
    writer = make_buffer(2, name="shared", shard="rank0")
    reader = make_buffer(2, name="shared", shard="rank0")
    writer.append(make_experience(71))
    assert len(reader) == 4
    reader.clear()
    assert len(reader) == 0
    writer.append(make_experience(72))  # the same writer object, appending after the reader cleared
    assert reader.items == []
    assert len(reader) == 4
    assert [e.index for e in reader.items] == [[7200], [7201], [7202], [7203]]
    reader.clear()
    # a writer in another process that never saw the clear
    run_python(
        MAKE_EXPERIENCES
        + f"""
from dockd.trainer_plugins.openrlhf import DockReplayBuffer
buf = DockReplayBuffer(2, address={dock_cluster.address!r}, name="shared", shard="rank0")
buf.append(make_experience(73))
buf.close()
"""
    )
    assert len(reader) == 4
    assert [e.index for e in reader.items] == [[7300], [7301], [7302], [7303]]
    # and a reader in another process, after this process's reader cleared, sees new appends
    reader.clear()
    out = run_python(
        MAKE_EXPERIENCES
        + f"""
from dockd.trainer_plugins.openrlhf import DockReplayBuffer
buf = DockReplayBuffer(2, address={dock_cluster.address!r}, name="shared", shard="rank0", consumer="other")
n = len(buf)          # everything still in the dock for a new consumer: only the uncleared samples
buf.clear()
print(n)
buf.close()
"""
    )
    assert out.strip() == "0"  # all 12 samples were deleted by the clears above
    writer.append(make_experience(74))
    assert len(reader) == 4


def test_is_a_naive_replay_buffer(make_buffer: Any, dock_cluster: dockd.LocalCluster) -> None:
    buf = make_buffer(2, name="isinst", shard="s0")
    assert isinstance(buf, NaiveReplayBuffer)
    assert issubclass(plugin.DockReplayBuffer, NaiveReplayBuffer)
    assert plugin.DockReplayBuffer is plugin.DockReplayBuffer  # built once
    assert buf.append(make_experience(81)) is not None  # documented difference: the dock indexes
    assert len(buf) == 4


class _Args:
    """The slice of OpenRLHF's args that NaiveReplayBuffer.setup_dynamic_batch reads."""

    def __init__(self, **sections: dict[str, Any]) -> None:
        for name, values in sections.items():
            setattr(self, name, type(name, (), values)())


class CpuStrategy:
    """CPU stand-in for the calls setup_dynamic_batch makes on OpenRLHF's DeepspeedStrategy:
    ``args``, ``ds_device_mesh["dp"].get_group()``, ``all_reduce(tensor, op)`` (the same body as
    DeepspeedStrategy.all_reduce, without the move to CUDA)."""

    def __init__(self, args: _Args) -> None:
        import torch.distributed as dist

        self.args = args
        self.world_size = dist.get_world_size()
        group = dist.group.WORLD
        self.ds_device_mesh = {"dp": type("Mesh", (), {"get_group": staticmethod(lambda: group)})()}

    def all_reduce(self, data: torch.Tensor, op: str = "mean") -> torch.Tensor:
        import torch.distributed as dist

        assert op in ("mean", "max", "sum")
        if op == "mean":
            data /= self.world_size
        dist.all_reduce(data, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return data


@pytest.fixture()
def gloo_world() -> Any:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_setup_dynamic_batch_matches_naive(
    make_buffer: Any, dock_cluster: dockd.LocalCluster, gloo_world: Any
) -> None:
    args = _Args(
        train={"batch_size": 8, "max_tokens_per_gpu": 20},
        rollout={"batch_size": 4, "n_samples_per_prompt": 2},
        ds={"ring_attn_size": 1, "tensor_parallel_size": 1},
    )
    strategy = CpuStrategy(args)
    buf = make_buffer(1, name="dyn", shard="s0", dynamic_batch=True)
    with mock.patch("torch.cuda.current_device", return_value=0):  # OpenRLHF's buffer needs a CUDA index
        naive = NaiveReplayBuffer(1, 0, True, False, True)
    for seed in (91, 92):
        buf.append(make_experience(seed))
        naive.append(make_experience(seed))
    assert not torch.cuda.is_available()  # the plugin runs OpenRLHF's counters on the CPU itself
    current_device = torch.cuda.current_device
    buf.setup_dynamic_batch(strategy)
    assert torch.cuda.current_device is current_device  # restored after the call
    with mock.patch("torch.cuda.current_device", return_value="cpu"):  # its counters, on the CPU
        naive.setup_dynamic_batch(strategy)
    assert buf.sample_batch_size == 1
    assert len(buf.dynamic_indices) > 1  # 20 tokens per micro-batch forces several
    assert buf.dynamic_indices == naive.dynamic_indices
    assert sorted(i for mb in buf.dynamic_indices for i in mb) == list(range(8))
    assert buf.dynamic_sample_loss_scale == naive.dynamic_sample_loss_scale
    assert buf.dynamic_batch_num_tokens == naive.dynamic_batch_num_tokens
    assert buf.dynamic_global_batch_size == naive.dynamic_global_batch_size
    assert buf.dynamic_optimizer_step == naive.dynamic_optimizer_step
    for mb in buf.dynamic_indices:  # each micro-batch stays within the token budget (or is one sample)
        assert len(mb) == 1 or sum(int(buf.items[i].total_length.item()) for i in mb) <= 20
    # the DataLoader pattern OpenRLHF's actor uses with dynamic batching: one micro-batch per item
    loader = DataLoader(buf, batch_size=buf.sample_batch_size, shuffle=False, collate_fn=buf.collate_fn)
    naive_loader = DataLoader(naive, batch_size=1, shuffle=False, collate_fn=naive.collate_fn)
    got, want = list(loader), list(naive_loader)
    assert len(got) == len(want) == len(buf.dynamic_indices)
    for g, w in zip(got, want):
        assert_same_experience(g, w)
    buf.clear()
    assert len(buf) == 0


def test_wait_blocks_then_times_out_clearly(make_buffer: Any, dock_cluster: dockd.LocalCluster) -> None:
    buf = make_buffer(2, name="wait", shard="s0")
    buf.append(make_experience(41))
    buf.wait(4, timeout=5.0)
    assert len(buf.items) == 4
    with pytest.raises(dockd.DockTimeout):
        buf.wait(6, timeout=0.2)


def test_no_address_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.ENV_ADDRESS, raising=False)
    buf = plugin.DockReplayBuffer(2)
    with pytest.raises(ValueError, match="DOCKD_ADDRESS"):
        buf.append(make_experience(1))


def test_install_switches_openrlhf_construction_sites(dock_cluster: dockd.LocalCluster) -> None:
    runtime_env = plugin.install(dock_cluster.address, name="inst")
    try:
        assert runtime_env["env_vars"][plugin.ENV_ADDRESS] == dock_cluster.address
        assert runtime_env["worker_process_setup_hook"] == "dockd.trainer_plugins.openrlhf._ray_worker_setup"
        # what ppo_actor.py / ppo_critic.py do: `from ..ppo_utils import NaiveReplayBuffer`, then build it
        from openrlhf.trainer.ppo_utils import NaiveReplayBuffer as Built

        buf = Built(2, 0, True, False, False)  # positional, as ActorPPOTrainer passes them
        assert isinstance(buf, plugin.DockReplayBuffer)
        assert buf.config.address == dock_cluster.address and buf.config.name == "inst"
        buf.append(make_experience(51))
        assert len(buf) == 4
        buf.close()
    finally:
        plugin.uninstall()
    from openrlhf.trainer.ppo_utils import NaiveReplayBuffer as Restored

    assert Restored is NaiveReplayBuffer


def test_ray_worker_hook_installs_in_a_fresh_process(dock_cluster: dockd.LocalCluster, run_python: Any) -> None:
    runtime_env = plugin.install(dock_cluster.address, name="hook")
    plugin.uninstall()
    out = run_python(
        """
        from dockd.trainer_plugins import openrlhf as plugin
        plugin._ray_worker_setup()
        from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
        b = NaiveReplayBuffer(2)
        print(type(b).__mro__[1].__name__, b.config.name, b.config.address)
        """,
        env=runtime_env["env_vars"],
    )
    assert out.split() == ["DockReplayBuffer", "hook", dock_cluster.address]


@pytest.mark.slow  # (CI runs it: make test-slow)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_install_reaches_ray_workers(dock_cluster: dockd.LocalCluster) -> None:
    """What OpenRLHF's actors do inside Ray: build NaiveReplayBuffer, append, read."""
    ray = pytest.importorskip("ray")
    runtime_env = plugin.install(dock_cluster.address, name="ray")
    try:
        runtime_env["env_vars"]["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"
        with mock.patch.dict("os.environ", {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}):
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
        try:

            @ray.remote
            def actor_side(code: str) -> tuple[str, int]:
                ns: dict[str, Any] = {}
                exec(code, ns)
                from openrlhf.trainer.ppo_utils import NaiveReplayBuffer as Built

                buf = Built(2, 0, True, False, False)
                buf.append(ns["make_experience"](61))
                n = len(buf)
                buf.close()
                return type(buf).__mro__[1].__name__, n

            name, n = ray.get(actor_side.remote(MAKE_EXPERIENCES), timeout=120)
        finally:
            ray.shutdown()
    finally:
        plugin.uninstall()
    assert (name, n) == ("DockReplayBuffer", 4)
