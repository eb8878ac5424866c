"""Collectives for the GRPO stages: backend per device, and how a TP group reads the dock.

Backend follows the device: gloo on CPU, NCCL on CUDA, HCCL on Ascend NPU
(``torch_npu``). Within a tensor-parallel group every rank needs the same
batch. Two ways, both here, chosen by ``GRPOConfig.tp_fetch``:

* ``"broadcast"``: the group's first rank fetches from the dock and broadcasts
  the batch (three collectives: header length, header, one flat payload);
* ``"replicate"``: every rank fetches the same samples itself, under its own
  consumer name (``"{consumer}@tp{rank}"``), and the group checks that all
  ranks got the same indexes.

The batch crosses the collective as raw bytes plus a msgpack header: no pickle.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dockd.trainer_plugins import _codec

logger = logging.getLogger(__name__)


def device_kind(device: torch.device | str) -> str:
    return torch.device(device).type


def collective_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for `device`: gloo (cpu), nccl (cuda), hccl (npu)."""
    kind = device_kind(device)
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
        except ImportError as exc:
            raise ImportError(
                "device 'npu' needs torch_npu (Ascend's PyTorch adapter), which could not be imported; "
                "install the torch_npu build matching your CANN version"
            ) from exc
        return "hccl"
    raise ValueError(f"no collective backend known for device {device!r}; use a cpu, cuda or npu device")


@dataclass(slots=True)
class LocalBatch:
    """A batch held by this rank: the same reading surface as `dockd.Batch`."""

    indexes: list[int]
    columns: dict[str, list[Any]]

    def __getitem__(self, column: str) -> list[Any]:
        return self.columns[column]

    def __len__(self) -> int:
        return len(self.indexes)

    def padded(self, column: str, pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.columns[column]
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        out = torch.full((len(values), int(lengths.max()) if len(values) else 0), pad_value, dtype=values[0].dtype)
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out, lengths


def to_local(batch: Any, columns: Sequence[str]) -> LocalBatch:
    return LocalBatch(indexes=list(batch.indexes), columns={c: list(batch[c]) for c in columns})


def _pack(batch: LocalBatch) -> tuple[bytes, torch.Tensor]:
    """Header (msgpack) + one flat uint8 payload holding every tensor value."""
    chunks: list[torch.Tensor] = []
    offset = 0
    cols: dict[str, list[Any]] = {}
    for name, values in batch.columns.items():
        entries: list[Any] = []
        for v in values:
            if isinstance(v, torch.Tensor):
                t = v.detach().to("cpu").contiguous()
                raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                entries.append(["t", str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel()])
                chunks.append(raw)
                offset += raw.numel()
            else:
                entries.append(["v", v])
        cols[name] = entries
    header = _codec.encode({"indexes": batch.indexes, "columns": cols}).numpy().tobytes()
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return header, payload


def _unpack(header: bytes, payload: torch.Tensor) -> LocalBatch:
    meta = _codec.decode(header)
    payload = payload.to("cpu")
    columns: dict[str, list[Any]] = {}
    for name, entries in meta["columns"].items():
        values: list[Any] = []
        for e in entries:
            if e[0] == "t":
                _, dtype, shape, off, nbytes = e
                dt = getattr(torch, dtype)
                if nbytes == 0:
                    values.append(torch.empty(shape, dtype=dt))
                else:
                    values.append(payload[off : off + nbytes].clone().view(dt).reshape(shape))
            else:
                values.append(e[1])
        columns[name] = values
    return LocalBatch(indexes=list(meta["indexes"]), columns=columns)


def broadcast_batch(
    batch: LocalBatch | None, *, src: int, group: Any, device: torch.device | str = "cpu"
) -> LocalBatch:
    """Broadcast `batch` from global rank `src` to every rank of `group` (others pass None)."""
    me = dist.get_rank()
    if me == src:
        assert batch is not None
        header, payload = _pack(batch)
        sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=device)
    else:
        sizes = torch.empty(2, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=src, group=group)
    n_header, n_payload = (int(x) for x in sizes.tolist())
    if me == src:
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        payload_t = payload.to(device)
    else:
        header_t = torch.empty(n_header, dtype=torch.uint8, device=device)
        payload_t = torch.empty(n_payload, dtype=torch.uint8, device=device)
    dist.broadcast(header_t, src=src, group=group)
    if n_payload:
        dist.broadcast(payload_t, src=src, group=group)
    if me == src:
        return batch
    return _unpack(header_t.cpu().numpy().tobytes(), payload_t)


class TPReader:
    """Reads one batch for every rank of a tensor-parallel group.

    Args:
        dock: this rank's `dockd.Dock` (only the source rank uses it in broadcast mode).
        mode: ``"broadcast"`` or ``"replicate"`` (see the module docstring).
        tp_group: the TP process group (``parallel_state.get_tensor_model_parallel_group()``).
        tp_src: global rank of the group's first rank (``get_tensor_model_parallel_src_rank()``).
        tp_rank: this rank's position in the group.
        device: where the collective runs (the rank's device).
    """

    def __init__(
        self,
        dock: Any,
        *,
        mode: str,
        tp_group: Any,
        tp_src: int,
        tp_rank: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if mode not in ("broadcast", "replicate"):
            raise ValueError(f"TPReader mode must be 'broadcast' or 'replicate', got {mode!r}")
        self.dock = dock
        self.mode = mode
        self.tp_group = tp_group
        self.tp_src = tp_src
        self.tp_rank = tp_rank
        self.device = device

    def get(self, *, consumer: str, columns: Sequence[str], **get_kwargs: Any) -> LocalBatch:
        """Every rank of the group returns the same batch (``dock.get`` semantics per group)."""
        if self.mode == "replicate":
            batch = to_local(self.dock.get(consumer=f"{consumer}@tp{self.tp_rank}", columns=list(columns), **get_kwargs), columns)
            self._check_same(batch.indexes, consumer)
            return batch
        local = None
        if dist.get_rank() == self.tp_src:
            local = to_local(self.dock.get(consumer=consumer, columns=list(columns), **get_kwargs), columns)
        return broadcast_batch(local, src=self.tp_src, group=self.tp_group, device=self.device)

    def _check_same(self, indexes: list[int], consumer: str) -> None:
        idx = torch.tensor(indexes, dtype=torch.int64)
        probe = torch.tensor(
            [len(indexes), int((idx * 2654435761).remainder(1 << 31).sum()) if len(indexes) else 0],
            dtype=torch.int64,
            device=self.device,
        )
        both = torch.cat([probe, -probe])  # one collective: min and (negated) max together
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.tp_group)
        if not torch.equal(both[:2], -both[2:]):
            raise RuntimeError(
                f"tp_fetch='replicate': the ranks of one tensor-parallel group got different samples from "
                f"consumer {consumer!r} (samples became ready out of index order); use tp_fetch='broadcast'"
            )
