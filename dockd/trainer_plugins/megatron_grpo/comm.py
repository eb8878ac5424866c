"""Collectives for the GRPO stages: backend per device, and how a TP group reads the dock.

Backend follows the device: gloo on CPU, NCCL on CUDA, HCCL on Ascend NPU
(``torch_npu``). Within a tensor-parallel group every rank needs the same
batch. Three ways, all here, chosen by ``GRPOConfig.tp_fetch`` (``"group"`` is
the default: it needs no collective and measured fastest on CPU, see
examples/tp_fetch_bench.py and docs/plugins.md):

* ``"broadcast"``: the group's first rank fetches from the dock and broadcasts
  the batch (three collectives: header length, header, one flat payload);
* ``"shared"``: the group's first rank acquires the samples (metadata only)
  and broadcasts the lease (indexes + warehouse locations only); every rank then
  fetches the data itself, through same-host shared memory where the
  warehouse is local;
* ``"group"``: no collective at all: every rank gets the batch itself with a
  model-parallel get (``mp_group=(group, tp_rank, tp_size)``); the dock hands
  all ranks of the group the same samples and counts them taken once every
  rank confirmed them.

The batch crosses the collective as raw bytes plus a msgpack header, never as Python objects.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import dockd
from dockd.client.tensordicts import tensor_field
from dockd.trainer_plugins import _codec
from dockd.trainer_plugins._lease import metadata_only

logger = logging.getLogger(__name__)


def device_kind(device: torch.device | str) -> str:
    if isinstance(device, str):  # "npu:0" only parses once torch_npu is imported
        return device.split(":")[0]
    return device.type


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
    """A batch held by this rank: the same reading surface as `dockd.Batch`. A column of equal-shaped
    tensors is held as one [n, ...] tensor (`stacked`), as the dock handed it over; any other as a list."""

    indexes: list[int]
    columns: dict[str, Any]

    def __getitem__(self, column: str) -> list[Any]:
        values = self.columns[column]
        return list(values.unbind(0)) if isinstance(values, torch.Tensor) else values

    def __len__(self) -> int:
        return len(self.indexes)

    def stacked(self, column: str) -> torch.Tensor:
        """A column of equal-shaped tensors as one [n, ...] tensor (the one held, no copy)."""
        values = self.columns[column]
        return values if isinstance(values, torch.Tensor) else torch.stack(values)

    def padded(self, column: str, pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        values = self[column]
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        out = torch.full((len(values), int(lengths.max()) if len(values) else 0), pad_value, dtype=values[0].dtype)
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out, lengths


def to_local(batch: Any, columns: Sequence[str]) -> LocalBatch:
    """A dock batch's columns: one of equal-shaped tensors as one tensor built from the received buffer
    (`Batch.stacked`: a view where it came as one run), no tensor per value; any other as a list."""
    local: dict[str, Any] = {}
    for c in columns:
        field = tensor_field(batch, c) if isinstance(batch, dockd.Batch) else None
        local[c] = field if field is not None and not field.is_nested else list(batch[c])
    return LocalBatch(indexes=list(batch.indexes), columns=local)


def _pack(batch: LocalBatch) -> tuple[bytes, torch.Tensor]:
    """Header (msgpack) + one flat uint8 payload holding every tensor value."""
    chunks: list[torch.Tensor] = []
    offset = 0
    cols: dict[str, list[Any]] = {}
    for name, values in batch.columns.items():
        if isinstance(values, torch.Tensor):  # a stacked column: one entry, one chunk
            t = values.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            cols[name] = ["T", str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel()]
            chunks.append(raw)
            offset += raw.numel()
            continue
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
    columns: dict[str, Any] = {}
    for name, entries in meta["columns"].items():
        if entries and entries[0] == "T":  # a stacked column
            _, dtype, shape, off, nbytes = entries
            dt = getattr(torch, dtype)
            columns[name] = payload[off: off + nbytes].clone().view(dt).reshape(shape) if nbytes else \
                torch.empty(shape, dtype=dt)
            continue
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
    """Broadcast `batch` from global rank `src` to every rank of `group` (others pass None).

    Two collectives: the sizes, then header and payload in one buffer.
    """
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
        buf = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), payload]).to(device)
    else:
        buf = torch.empty(n_header + n_payload, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    if me == src:
        assert batch is not None
        return batch
    buf = buf.cpu()
    return _unpack(buf[:n_header].numpy().tobytes(), buf[n_header:])


def _broadcast_bytes(raw: bytes | None, *, src: int, group: Any, device: torch.device | str) -> bytes:
    me = dist.get_rank()
    size = torch.tensor([len(raw) if me == src and raw is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if me == src:
        assert raw is not None
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return raw if me == src and raw is not None else buf.cpu().numpy().tobytes()


def _make_lease(meta: dict[str, Any]) -> Any:
    args = (meta["id"], meta["partition"], list(meta["columns"]), list(meta["indexes"]), meta["locations"])
    inline = meta.get("inline") or {}
    return dockd.Lease(*args, inline=inline) if inline else dockd.Lease(*args)


class TPReader:
    """Reads one batch for every rank of a tensor-parallel group.

    Args:
        dock: this rank's `dockd.Dock`.
        mode: ``"broadcast"`` (the first rank fetches and broadcasts the data) or
            ``"shared"`` (the first rank acquires, broadcasts only the lease — indexes and
            warehouse locations — and every rank fetches the data itself from the
            warehouses, through same-host shared memory where it is local) or ``"group"``
            (every rank gets the batch with a model-parallel get; no collective).
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
        if mode not in ("broadcast", "shared", "group"):
            raise ValueError(f"TPReader mode must be 'broadcast', 'shared' or 'group', got {mode!r}")
        self.dock = dock
        self.mode = mode
        self.tp_group = tp_group
        self.tp_src = tp_src
        self.tp_rank = tp_rank
        self.device = device

    def get(self, *, consumer: str, columns: Sequence[str], **get_kwargs: Any) -> LocalBatch:
        """Every rank of the group returns the same batch (``dock.get`` semantics per group)."""
        if self.mode == "shared":
            return self._get_shared(consumer, columns, get_kwargs)
        if self.mode == "group":
            # the group is named by its data-parallel rank in a rank-aware get, else by its first rank
            gid = get_kwargs["dp_rank"] if get_kwargs.get("dp_size") is not None else self.tp_src
            size = dist.get_world_size(self.tp_group)
            batch = self.dock.get(consumer=consumer, columns=list(columns), mp_group=(gid, self.tp_rank, size),
                                  **get_kwargs)
            return to_local(batch, columns)
        local = None
        if dist.get_rank() == self.tp_src:
            local = to_local(self.dock.get(consumer=consumer, columns=list(columns), **get_kwargs), columns)
        return broadcast_batch(local, src=self.tp_src, group=self.tp_group, device=self.device)

    def _get_shared(self, consumer: str, columns: Sequence[str], get_kwargs: dict[str, Any]) -> LocalBatch:
        src = dist.get_rank() == self.tp_src
        lease = None
        raw = None
        if src:
            try:
                lease = self.dock.acquire(consumer, list(columns), inline=False, **get_kwargs)
                locations, inline = metadata_only(self.dock, lease)
                raw = (
                    _codec.encode(
                        {
                            "id": lease.id,
                            "partition": lease.partition,
                            "columns": lease.columns,
                            "indexes": lease.indexes,
                            "locations": locations,
                            "inline": inline,  # empty unless the controller's warehouse is unknown
                        }
                    )
                    .numpy()
                    .tobytes()
                )
            except Exception as exc:  # tell the peers, then raise here
                raw = _codec.encode({"error": f"{type(exc).__name__}: {exc}"}).numpy().tobytes()
                _broadcast_bytes(raw, src=self.tp_src, group=self.tp_group, device=self.device)
                raise
        meta = _codec.decode(_broadcast_bytes(raw, src=self.tp_src, group=self.tp_group, device=self.device))
        if "error" in meta:
            raise RuntimeError(
                f"the first rank of this tensor-parallel group could not acquire samples: {meta['error']}"
            )
        if not src:
            lease = _make_lease(meta)
        values = self.dock.fetch(lease, batch=True)
        if src:
            # the data stays readable until the partition is cleared, so the first rank
            # confirms after its own fetch; a peer whose fetch fails raises on its side
            self.dock.confirm(lease)
        assert lease is not None
        return to_local(values, columns)
