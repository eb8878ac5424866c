"""The OpenRLHF replay buffer backed by the dock (see `dockd.trainer_plugins.openrlhf`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import dockd
from dockd.config import env
from dockd.trainer_plugins import _codec, require

if TYPE_CHECKING:  # pragma: no cover
    from openrlhf.trainer.ppo_utils import Experience

logger = logging.getLogger(__name__)

ENV_ADDRESS = "DOCKD_ADDRESS"
"""Environment variable naming the dock (``host:port``) when no address is given."""
ENV_CONFIG = "DOCKD_OPENRLHF_CONFIG"
"""Environment variable carrying `install`'s buffer config (JSON) into Ray workers."""

PACKAGE = "dockd.trainer_plugins.openrlhf"
"""Where the buffer class lives for users, pickles and Ray (this module is a part of it)."""

META_COLUMN = "exp/meta"
_EMPTY = torch.empty(0, dtype=torch.uint8)


def _openrlhf(module: str = "openrlhf.trainer.ppo_utils.experience") -> Any:
    return require(module, extra="openrlhf", what=PACKAGE)


@dataclass(kw_only=True, slots=True)
class DockBufferConfig:
    """Where a `DockReplayBuffer` keeps its samples."""

    address: str | None = None
    """Dock address ``host:port``; None reads the ``DOCKD_ADDRESS`` environment variable."""
    name: str = "openrlhf"
    """Partition prefix; buffers with the same name and shard share samples."""
    shard: str | None = None
    """Stream within ``name``; None means ``"rank{R}"`` with R the torch.distributed rank
    (0 without a process group), which keeps OpenRLHF's per-rank buffers apart."""
    consumer: str = "train"
    """Consumer name the reader pulls with; each consumer sees each sample once."""
    read_timeout: float = 0.0
    """Seconds `__len__`/`sample` wait for at least one new sample before using what is
    already local. 0 takes only what is ready now."""
    put_timeout: float = 60.0
    """Seconds an append waits for warehouse capacity before DockFull."""
    clear_remote: bool = True
    """`clear` also deletes from the dock the samples it drops (those this buffer pulled),
    freeing their memory; turn off when several consumers read one shard and one must not
    delete samples another has not read yet."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"DockBufferConfig.name must be a non-empty string without '/', got {self.name!r}")
        if self.shard is not None and (not self.shard or "/" in self.shard):
            raise ValueError(
                f"DockBufferConfig.shard must be None or a non-empty string without '/', got {self.shard!r}"
            )
        if self.read_timeout < 0 or self.put_timeout < 0:
            raise ValueError("DockBufferConfig timeouts must be >= 0 seconds")

    def resolved_address(self) -> str:
        address = self.address or env(ENV_ADDRESS)
        if not address:
            raise ValueError(
                "DockReplayBuffer has no dock address: pass address='host:port' (or DockBufferConfig(address=...)), "
                f"or set the {ENV_ADDRESS} environment variable, e.g. to the address `dockd serve` printed"
            )
        return address


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class _DockReplayBufferImpl:
    """Drop-in for OpenRLHF's ``NaiveReplayBuffer`` backed by dockd.

    ``DockReplayBuffer`` (this module's attribute) is this class with OpenRLHF's
    ``NaiveReplayBuffer`` as a further base when OpenRLHF is importable, so
    ``isinstance(buffer, NaiveReplayBuffer)`` holds. `append` returns the dock indexes of
    the new samples (the original returns None).

    Args:
        sample_batch_size: batch size of `sample` and of OpenRLHF's DataLoader.
        limit: keep at most this many samples in the local view (oldest dropped); <= 0: unlimited.
        cpu_offload: move experiences to CPU on append and to the training device on `sample`.
        packing_samples: passed to ``make_experience_batch`` like OpenRLHF does.
        dynamic_batch: OpenRLHF's dynamic batching (``setup_dynamic_batch``) as in the original.
        config: where the samples live (`DockBufferConfig`); keyword overrides below win.
        address: shortcut for the same `DockBufferConfig` field.
        name: shortcut for the same `DockBufferConfig` field.
        shard: shortcut for the same `DockBufferConfig` field.
        consumer: shortcut for the same `DockBufferConfig` field.
    """

    _default_config: DockBufferConfig | None = None  # set by `install` on the installed subclass

    def __init__(
        self,
        sample_batch_size: int,
        limit: int = 0,
        cpu_offload: bool = True,
        packing_samples: bool = False,
        dynamic_batch: bool = False,
        *,
        config: DockBufferConfig | None = None,
        address: str | None = None,
        name: str | None = None,
        shard: str | None = None,
        consumer: str | None = None,
    ) -> None:
        experience_mod = _openrlhf()
        self._exp_mod = experience_mod
        self._Experience = experience_mod.Experience
        base = config or self._default_config or DockBufferConfig()
        overrides: dict[str, Any] = {
            k: v for k, v in dict(address=address, name=name, shard=shard, consumer=consumer).items() if v
        }
        self.config = dataclasses.replace(base, **overrides) if overrides else base
        self.sample_batch_size = sample_batch_size
        self.limit = limit
        self.cpu_offload = cpu_offload
        self.packing_samples = packing_samples
        self.dynamic_batch = dynamic_batch
        self.target_device = (
            torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
        )
        self.items: list[Experience] = []
        self.dynamic_indices: list[list[int]] = []
        self.dynamic_sample_loss_scale: list[float] = []
        self.dynamic_batch_num_tokens: list[float] = []
        self.dynamic_global_batch_size: list[float] = []
        self.dynamic_optimizer_step: list[int] = []
        self._held: list[int] = []  # dock indexes pulled since the last clear (dropped by `limit` too)
        self._shard = self.config.shard or f"rank{_rank()}"
        self._dock: Any = None
        tensor_fields, other_fields = [], []
        for f in dataclasses.fields(self._Experience):
            if f.metadata.get("tensor_role") in ("step", "episode"):
                tensor_fields.append(f.name)
            else:
                other_fields.append(f.name)
        self._tensor_fields = tensor_fields
        self._other_fields = other_fields
        self._columns = [f"exp/{n}" for n in tensor_fields] + [META_COLUMN]

    # -- the dock --------------------------------------------------------------------
    @property
    def dock(self) -> Any:
        """The `dockd.Dock` this buffer talks to (connected on first use)."""
        if self._dock is None:
            self._dock = dockd.connect(self.config.resolved_address())
        return self._dock

    @property
    def partition(self) -> str:
        """The dock partition appends go to and reads come from (fixed for the buffer's life)."""
        return f"{self.config.name}/{self._shard}"

    def close(self) -> None:
        """Close this buffer's connection (the samples stay in the dock)."""
        if self._dock is not None:
            self._dock.close()
            self._dock = None

    def __getstate__(self) -> dict[str, Any]:
        # picklable for Ray: the connection is re-opened on the other side
        state = self.__dict__.copy()
        state["_dock"] = None
        state["_exp_mod"] = None
        state["_Experience"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._exp_mod = _openrlhf()
        self._Experience = self._exp_mod.Experience

    # -- NaiveReplayBuffer API -----------------------------------------------------
    @torch.no_grad()
    def append(self, experience: Experience) -> list[int]:
        """Split `experience` per sample, strip right padding, put the samples into the dock.

        The samples are what OpenRLHF's ``split_experience_batch`` and ``remove_padding_in_sequences``
        make of it, bit for bit, but each step field goes to the dock as one jagged column (one buffer
        of the rows' unpadded prefixes plus offsets) and each episode field as one batched column: no
        tensor per sample. Returns the dock indexes of the new samples.
        """
        if self.cpu_offload:
            experience.to_device(torch.device("cpu"))
        n = _batch_size(experience)
        if n == 0:
            return []
        columns: dict[str, Any] = {f"exp/{name}": self._column(experience, name, n) for name in self._tensor_fields}
        none_fields = [name for name in self._tensor_fields if getattr(experience, name) is None]
        # the per-sample metadata as OpenRLHF splits it, on a copy without the tensor fields
        shell = dataclasses.replace(experience, **{name: None for name in self._tensor_fields})
        shell.sequences = list(range(n))  # (split_experience_batch counts the samples by it)
        items = self._exp_mod.split_experience_batch(shell)
        index = experience.index
        if isinstance(index, list) and len(index) == n:
            for i, item in enumerate(items):  # OpenRLHF drops `index` here; keep it per sample
                item.index = [index[i]]
        columns[META_COLUMN] = [
            _codec.encode({"none": none_fields, "fields": {name: getattr(item, name) for name in self._other_fields}})
            for item in items
        ]
        indexes = self.dock.put(columns, partition=self.partition, timeout=self.config.put_timeout)
        logger.debug("[openrlhf] appended samples=%d partition=%s", n, self.partition)
        return list(indexes)

    def _column(self, experience: Experience, name: str, n: int) -> Any:
        """Tensor field `name` of a batched experience as one column of `n` samples: a step field
        without each row's right padding (``remove_padding_in_sequences``: as many positions as the
        attention mask pads, cut off the end) as a `dockd.Jagged`, an episode field as it is, None as
        an empty uint8 value per sample."""
        value = getattr(experience, name)
        if value is None:
            return _EMPTY.expand(n, 0)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Experience.{name} must be a tensor or None, got {type(value).__name__}")
        if len(value) != n:
            raise ValueError(f"Size of {name} ({len(value)}) does not match batch_size ({n})")
        value = value.detach()
        if not self._Experience.is_step_tensor_field(name):
            return value.to("cpu").contiguous()
        width = value.shape[1]
        lengths = (width - _right_pad(experience)).clamp_(min=0)
        value = value.contiguous()
        if bool((lengths == width).all()):  # no padding: the tensor's own buffer
            flat = value.view(n * width, *value.shape[2:])
        else:
            flat = _prefixes(value, lengths.to(value.device))
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(lengths.to("cpu", torch.int64), 0, out=offsets[1:])
        return dockd.Jagged(flat.to("cpu"), offsets)

    def clear(self) -> None:
        """Drop every sample ready for this buffer's consumer now, locally and in the dock.

        Pulls what is ready first (so ``append`` then ``clear`` leaves nothing behind, as
        with ``NaiveReplayBuffer``), then empties the local view and, with
        ``config.clear_remote``, deletes those samples from the dock (`dockd.Dock.delete`).
        Samples appended after this call, by this buffer or by any other buffer with the
        same name and shard, are seen by the next read: the partition never changes.
        """
        self.pull(timeout=0.0)
        held, self._held = self._held, []
        self.items.clear()
        self.dynamic_indices = []
        if self.config.clear_remote and held:
            try:
                self.dock.delete(self.partition, held)
            except dockd.DockNotFound as exc:  # the partition was cleared by someone else
                logger.debug("[openrlhf] delete partition=%s: %s", self.partition, exc)

    @torch.no_grad()
    def sample(self) -> Experience:
        """A random batch of `sample_batch_size` samples, like NaiveReplayBuffer.sample."""
        self.pull()
        if len(self.items) < self.sample_batch_size:
            raise ValueError(
                f"DockReplayBuffer.sample needs {self.sample_batch_size} samples but partition "
                f"{self.partition!r} has delivered {len(self.items)} to consumer {self.config.consumer!r}; "
                "append more experiences first or call wait(n, timeout) to block until they arrive"
            )
        items = random.sample(self.items, self.sample_batch_size)
        experience = self._exp_mod.make_experience_batch(items, self.packing_samples)
        if self.cpu_offload:
            experience.to_device(self.target_device)
        return experience

    def __len__(self) -> int:
        self.pull()
        if self.dynamic_batch:
            return len(self.dynamic_indices)
        return len(self.items)

    def __getitem__(self, idx: int) -> Experience | list[Experience]:
        if self.dynamic_batch:
            return [self.items[i] for i in self.dynamic_indices[idx]]
        return self.items[idx]

    def collate_fn(self, batch: list[Any]) -> Experience:
        if self.dynamic_batch:
            batch = batch[0]
        return self._exp_mod.make_experience_batch(batch, self.packing_samples)

    def setup_dynamic_batch(self, strategy: Any) -> None:
        """OpenRLHF's own dynamic batching, run on the samples pulled from the dock.

        It uses the strategy's ``args``, ``ds_device_mesh["dp"].get_group()`` and
        ``all_reduce``, and ``torch.distributed`` collectives over that group. OpenRLHF puts
        its counters on ``torch.cuda.current_device()``; on a machine without CUDA this
        runs them on the CPU instead (``torch.cuda.current_device`` answers ``"cpu"`` for
        the duration of the call), so a gloo group works.
        """
        self.pull()
        naive = _openrlhf("openrlhf.trainer.ppo_utils.replay_buffer").NaiveReplayBuffer
        with _cpu_as_cuda_device():
            naive.setup_dynamic_batch(self, strategy)

    # -- reading from the dock -----------------------------------------------------
    def pull(self, timeout: float | None = None) -> int:
        """Move every sample ready for this buffer's consumer into the local view.

        Waits up to `timeout` (default `DockBufferConfig.read_timeout`) for the first one.
        Returns how many samples arrived.
        """
        timeout = self.config.read_timeout if timeout is None else timeout
        got = 0
        while True:
            try:
                batch = self.dock.get(
                    consumer=self.config.consumer,
                    columns=self._columns,
                    count=1 << 20,
                    partition=self.partition,
                    allow_partial=True,
                    timeout=timeout if got == 0 else 0.0,
                )
            except dockd.DockTimeout:
                break
            except dockd.DockNotFound:  # nothing was ever appended to this partition
                break
            got += self._ingest(batch)
        return got

    def wait(self, count: int, timeout: float) -> None:
        """Block until the local view holds at least `count` samples, or raise DockTimeout."""
        missing = count - len(self.items)
        if missing > 0:
            batch = self.dock.get(
                consumer=self.config.consumer,
                columns=self._columns,
                count=missing,
                partition=self.partition,
                timeout=timeout,
            )
            self._ingest(batch)

    def _ingest(self, batch: Any) -> int:
        n = len(batch.indexes)
        metas = batch[META_COLUMN]
        tensors = {name: batch[f"exp/{name}"] for name in self._tensor_fields}
        for i in range(n):
            meta = _codec.decode(metas[i])
            kwargs: dict[str, Any] = dict(meta["fields"])
            none = set(meta["none"])
            for name in self._tensor_fields:
                kwargs[name] = None if name in none else tensors[name][i]
            self.items.append(self._Experience(**kwargs))
        self._held.extend(int(i) for i in batch.indexes)
        if self.limit > 0 and len(self.items) > self.limit:
            del self.items[: len(self.items) - self.limit]
        return n


def _batch_size(experience: Experience) -> int:
    if experience.sequences is None:
        raise ValueError("Experience.sequences is None; DockReplayBuffer.append needs a batched experience")
    return len(experience.sequences)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _prefixes(value: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Row i's first lengths[i] positions of a contiguous [n, width, ...] tensor, back to back: one masked
    copy of the bytes as they are (through an integer view of the same item size: bit-exact for any dtype).
    On the CPU through numpy, on this thread: torch's masked copy of a batch this size goes to its thread
    pool, which on a machine whose cores are busy took 13-116 ms per call against numpy's 0.1-0.7 ms
    (64 x 1024 int64, two threads, 2-core VM)."""
    n, width = value.shape[:2]
    if value.device.type == "cpu":
        picked = np.arange(width)[None, :] < lengths.numpy()[:, None]
        raw = value.view(n, width, -1).view(torch.uint8).numpy()
        return torch.from_numpy(raw[picked]).view(value.dtype).view(-1, *value.shape[2:])
    keep = torch.arange(width, device=value.device)[None, :] < lengths[:, None]
    as_int = _SAME_SIZE_INT.get(value.element_size())
    if value.dim() == 2 and as_int is not None:
        return value.view(as_int).masked_select(keep).view(value.dtype)
    rows = value.view(n, width, -1).view(torch.uint8)
    return rows[keep].view(value.dtype).view(-1, *value.shape[2:])


def _right_pad(experience: Experience) -> torch.Tensor:
    """Each sample's right padding, as ``remove_padding_in_sequences`` counts it: the positions after the
    attention mask's last maximum (int64 on the CPU)."""
    mask = experience.attention_mask
    if mask is None:
        raise ValueError("Experience.attention_mask is None; the buffer strips each sample's right padding by it")
    if mask.device.type == "cpu":  # (numpy, on this thread: see _prefixes)
        return torch.from_numpy(np.argmax(mask.numpy()[:, ::-1], axis=1).astype(np.int64))
    return mask.flip(1).argmax(1).to("cpu", torch.int64)


@contextlib.contextmanager
def _cpu_as_cuda_device() -> Any:
    """Without CUDA, let ``torch.cuda.current_device()`` name the CPU while OpenRLHF code runs."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a name, not an index
    try:
        yield
    finally:
        torch.cuda.current_device = original


_buffer_class: type | None = None


def _dock_replay_buffer_class() -> type:
    """`_DockReplayBufferImpl` with OpenRLHF's ``NaiveReplayBuffer`` as a base when importable."""
    global _buffer_class
    if _buffer_class is not None:
        return _buffer_class
    try:
        naive = _openrlhf("openrlhf.trainer.ppo_utils.replay_buffer").NaiveReplayBuffer
    except ImportError:  # no OpenRLHF: the plain class (its constructor names the extra)
        return _DockReplayBufferImpl
    _buffer_class = type(
        "DockReplayBuffer",
        (_DockReplayBufferImpl, naive),
        {"__module__": PACKAGE, "__qualname__": "DockReplayBuffer", "__doc__": _DockReplayBufferImpl.__doc__},
    )
    return _buffer_class
