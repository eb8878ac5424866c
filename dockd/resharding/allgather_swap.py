"""allgather-swap: switch model weights from the training to the generation layout.

``enter_generation()`` runs these phases on every rank::

    alloc      one contiguous bucket per dtype for ALL generation weights,
               laid out stage by stage so each stage is one region per dtype
    gather     for each dense parameter of this rank's stage, one at a time:
               all-gather the TP shards into a temporary buffer, copy the
               slice this rank needs under the generation TP (shrink or grow,
               fused QKV / gate-up blocks re-cut block by block), free it
    experts    for each expert parameter: all-to-all over the EP group, every
               peer receiving its generation-TP slice of every expert
    broadcast  each stage's regions are broadcast over the PP group
               (when generation TP ranks differ inside a PP group, path
               "param_broadcast" replaces gather/experts/broadcast with a
               per-parameter broadcast of the gathered tensor)
    swap_out   (mode "swap") the update weights go to the pinned host pool
               and their device storage is freed

``exit_generation()`` frees the buckets and brings the update weights back
(or waits for ``prefetch_update_weights()``, which started that early on a
side stream).  Mode ``"resident"`` is the naive reference: the same buckets,
but the update weights stay on the device the whole time.

Each call leaves a :class:`ReshardReport` in ``last_report``.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from .collectives import Collectives, DeviceCollectives, TorchCollectives
from .device import DeviceInfo, device_of
from .errors import BackendError, LayoutError, ReshardStateError
from .groups import ReshardGroups, build_groups
from .layout import (
    DEFAULT_GATHER_CHUNK_BYTES,
    ParallelLayout,
    ParamSpec,
    gather_chunk_rows,
    generation_local_shape,
    plan_reslice,
    training_local_shape,
    validate_layouts,
)
from .swap import ByteAccountant, UpdateWeightSwapper

__all__ = ["AllGatherSwap", "ReshardConfig", "ReshardReport", "ReshardState"]

logger = logging.getLogger(__name__)

_BUCKET_ALIGN_BYTES = 256


@dataclass(kw_only=True, slots=True)
class ReshardConfig:
    """Knobs of :class:`AllGatherSwap`."""

    mode: Literal["swap", "resident"] = "swap"
    """``"swap"``: allgather-swap (update weights leave the device during
    generation).  ``"resident"``: the naive reference that keeps them."""
    chunk_bytes: int = 64 << 20
    """Chunk size of host-to-device copies when swapping back."""
    gather_chunk_bytes: int | None = DEFAULT_GATHER_CHUNK_BYTES
    """Bound on one all-gather temporary: larger parameters are gathered in
    chunks of rows (at least one row per TP rank).  ``None`` gathers each
    parameter whole."""

    def __post_init__(self) -> None:
        if self.mode not in ("swap", "resident"):
            raise LayoutError(f"ReshardConfig.mode must be 'swap' or 'resident', got {self.mode!r}")
        if self.chunk_bytes <= 0:
            raise LayoutError(f"ReshardConfig.chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.gather_chunk_bytes is not None and self.gather_chunk_bytes <= 0:
            raise LayoutError(
                f"ReshardConfig.gather_chunk_bytes must be positive or None, got {self.gather_chunk_bytes}"
            )


@dataclass(kw_only=True, slots=True)
class ReshardReport:
    """What one call moved, held and spent.  Byte counts are for this rank."""

    call: str
    mode: str
    gathered_bytes: int = 0
    """Output bytes of the TP all-gathers (temporary buffers)."""
    alltoall_bytes: int = 0
    """Expert bytes received by the EP all-to-alls."""
    broadcast_bytes: int = 0
    """Bucket bytes moved by the PP broadcasts (sent or received)."""
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    """exit_generation: update bytes made resident again, including those a
    prefetch already copied (then ``prefetched`` is true)."""
    prefetched: bool = False
    """exit_generation: the swap-back had been started by prefetch."""
    pinned: bool = False
    device_bytes_before: int = 0
    device_bytes_after: int = 0
    peak_device_bytes: int = 0
    """Peak of the module's device-byte accounting during the call."""
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    def gbps(self, phase: str, nbytes: int) -> float:
        """Throughput of ``nbytes`` over ``phase`` in GB/s (0 if not timed)."""
        seconds = self.phase_seconds.get(phase, 0.0)
        return nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReshardState(enum.Enum):
    TRAINING = "training"
    GENERATION = "generation"
    CLOSED = "closed"


@dataclass(slots=True)
class _Placement:
    dtype: torch.dtype
    offset: int
    numel: int
    shape: tuple[int, ...]


class AllGatherSwap:
    """Reshard this rank's training shards into generation weights and back.

    ``update_weights`` maps the names of this rank's pipeline stage to its
    training shards (shapes from :func:`training_local_shape`); the tensors
    remain the caller's, and are emptied (storage size 0) during generation
    in ``"swap"`` mode.  ``torch.distributed`` must be initialised with the
    backend matching the weights' device (gloo/cpu, nccl/cuda, hccl/npu).

    ``collectives="device"`` moves the bytes through dockd's own NCCL/HCCL
    bindings instead (weights on CUDA or NPU; ``torch.distributed`` may then be
    any backend, gloo included: it only hands out the communicators' unique
    ids). A :class:`~dockd.resharding.collectives.Collectives` object of the
    caller's (e.g. ``DeviceCollectives(groups, comms)`` over communicators it
    made) is used as given and not closed.
    """

    def __init__(
        self,
        specs: list[ParamSpec],
        update_weights: dict[str, torch.Tensor],
        *,
        train: ParallelLayout,
        gen: ParallelLayout,
        config: ReshardConfig | None = None,
        groups: ReshardGroups | None = None,
        collectives: Collectives | Literal["torch", "device"] = "torch",
    ) -> None:
        if not isinstance(collectives, Collectives) and collectives not in ("torch", "device"):
            raise LayoutError(f"collectives must be 'torch', 'device' or a Collectives object, got {collectives!r}")
        self.config = config or ReshardConfig()
        self.device: DeviceInfo = device_of(list(update_weights.values()))
        if collectives == "torch":
            self.device.check_backend()
        elif not dist.is_available() or not dist.is_initialized():
            raise BackendError("torch.distributed is not initialised; allgather-swap takes ranks and groups from "
                               "it (any backend will do with collectives='device')")
        if collectives == "device" and not self.device.is_accelerator:
            raise BackendError(f"collectives='device' moves weights through NCCL/HCCL, but they are on "
                               f"{self.device.type}; use collectives='torch' (gloo) for CPU weights")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        validate_layouts(specs, train, gen, self.world_size)
        self.train, self.gen, self.specs = train, gen, list(specs)
        self.coords = train.coords(self.rank, self.world_size)
        self.gen_tp_rank = self.rank % gen.tp
        self._stage_specs = [s for s in self.specs if s.stage == self.coords.pp_rank]
        self._check_update_weights(update_weights)
        self._update = dict(update_weights)

        self._owns_groups = groups is None
        self.groups = groups if groups is not None else build_groups(train)
        for dim, ranks, size, pos in (
            ("tp", self.groups.tp_ranks, train.tp, self.coords.tp_rank),
            ("pp", self.groups.pp_ranks, train.pp, self.coords.pp_rank),
            ("ep", self.groups.ep_ranks, train.ep, self.coords.ep_rank),
        ):
            if len(ranks) != size or ranks[pos] != self.rank:
                raise LayoutError(
                    f"{dim} group {ranks} does not match training {dim}={size} for rank {self.rank} "
                    f"({dim} rank {pos} in tp-dp-pp order); list the group's ranks in {dim}-rank order"
                )
        self._ep_peer_gen_ranks = [r % gen.tp for r in self.groups.ep_ranks]
        self._owns_coll = not isinstance(collectives, Collectives)
        if collectives == "torch":
            self.coll: Collectives = TorchCollectives(self.groups)
        elif collectives == "device":
            self.coll = DeviceCollectives.connect(self.groups, self.device.torch_device)
        else:
            self.coll = collectives
        # Fast path: all members of a pipeline group share one generation TP
        # rank, so each stage's finished buckets can simply be broadcast.
        same = len({r % gen.tp for r in self.groups.pp_ranks}) == 1
        self.path: Literal["stage_broadcast", "param_broadcast"] = (
            "stage_broadcast" if same else "param_broadcast"
        )
        if not same:
            logger.info(
                "[reshard] path=param_broadcast: generation tp=%d does not divide the %d ranks of a "
                "training stage, so full parameters are broadcast over the pipeline group one at a time",
                gen.tp, train.tp * train.dp(self.world_size),
            )

        self._placements, self._bucket_numel, self._regions = self._plan_buckets()
        self.accountant = ByteAccountant()
        self._swapper = UpdateWeightSwapper(
            self._update, self.device, self.accountant, chunk_bytes=self.config.chunk_bytes
        )
        self.accountant.alloc(self._swapper.total_bytes)  # the update weights start resident
        self._buckets: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}
        self.state = ReshardState.TRAINING
        self.last_report: ReshardReport | None = None
        logger.info(
            "[reshard] ready rank=%d device=%s mode=%s path=%s train=tp%d/pp%d/ep%d gen=tp%d "
            "update_bytes=%d gen_bytes=%d",
            self.rank, self.device.type, self.config.mode, self.path, train.tp, train.pp, train.ep,
            gen.tp, self._swapper.total_bytes, self.generation_bytes,
        )

    # ------------------------------------------------------------------ setup
    def _check_update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        expected = {s.name for s in self._stage_specs}
        missing = sorted(expected - weights.keys())
        extra = sorted(weights.keys() - expected)
        if missing or extra:
            raise LayoutError(
                f"rank {self.rank} (pipeline stage {self.coords.pp_rank}) must pass exactly the "
                f"update weights of its stage; missing={missing[:8]} unexpected={extra[:8]}"
            )
        for spec in self._stage_specs:
            t = weights[spec.name]
            want = training_local_shape(spec, self.train)
            if tuple(t.shape) != want or t.dtype != spec.dtype:
                raise LayoutError(
                    f"update weight {spec.name!r} on rank {self.rank} is {tuple(t.shape)} "
                    f"{t.dtype}; the training layout needs {want} {spec.dtype}"
                )

    def _plan_buckets(
        self,
    ) -> tuple[dict[str, _Placement], dict[torch.dtype, int], dict[tuple[int, torch.dtype], tuple[int, int]]]:
        placements: dict[str, _Placement] = {}
        numel: dict[torch.dtype, int] = {}
        regions: dict[tuple[int, torch.dtype], tuple[int, int]] = {}
        for stage in range(self.train.pp):
            starts = dict(numel)
            for spec in (s for s in self.specs if s.stage == stage):
                align = max(1, _BUCKET_ALIGN_BYTES // spec.dtype.itemsize)
                offset = -(-numel.get(spec.dtype, 0) // align) * align
                shape = generation_local_shape(spec, self.gen)
                n = 1
                for s in shape:
                    n *= s
                placements[spec.name] = _Placement(spec.dtype, offset, n, shape)
                numel[spec.dtype] = offset + n
            for dtype, end in numel.items():
                start = starts.get(dtype, 0)
                if end > start:
                    regions[(stage, dtype)] = (start, end - start)
        return placements, numel, regions

    # ------------------------------------------------------------- properties
    @property
    def generation_bytes(self) -> int:
        """Bytes of the generation buckets (all dtypes, with alignment)."""
        return sum(n * d.itemsize for d, n in self._bucket_numel.items())

    @property
    def update_bytes(self) -> int:
        """Bytes of the distinct storages behind the update weights."""
        return self._swapper.total_bytes

    @property
    def device_bytes(self) -> int:
        """Device bytes the module currently accounts for (update weights
        while resident + generation buckets + temporaries)."""
        return self.accountant.current

    @property
    def host_bytes(self) -> int:
        """Bytes of the host pool (0 before the first swap-out)."""
        pool = self._swapper.pool
        return pool.nbytes if pool is not None else 0

    @property
    def host_pool(self) -> torch.Tensor | None:
        pool = self._swapper.pool
        return pool.buffer if pool is not None else None

    @property
    def generation_weights(self) -> dict[str, torch.Tensor]:
        self._require(ReshardState.GENERATION, "generation_weights")
        return dict(self._views)

    def _require(self, state: ReshardState, call: str) -> None:
        if self.state is not state:
            hint = {
                ReshardState.TRAINING: "call enter_generation() first",
                ReshardState.GENERATION: "call exit_generation() first",
                ReshardState.CLOSED: "this AllGatherSwap was closed; build a new one",
            }[self.state]
            raise ReshardStateError(f"{call}() needs state {state.value}, but it is {self.state.value}: {hint}")

    def _tick(self, phases: dict[str, float], name: str, t0: float) -> float:
        self.device.synchronize()
        t = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + (t - t0)
        return t

    def _temp(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device.torch_device)
        self.accountant.alloc(t.nbytes)
        return t

    def _release(self, t: torch.Tensor) -> None:
        """Account a temporary as freed; the caller drops its references so
        that the allocator really gets the memory back."""
        self.accountant.free(t.nbytes)

    # ------------------------------------------------------------ generation
    @torch.no_grad()
    def enter_generation(self) -> dict[str, torch.Tensor]:
        """Build the generation weights; returns ``name -> tensor`` views into
        the buckets (valid until :meth:`exit_generation`)."""
        self._require(ReshardState.TRAINING, "enter_generation")
        self._swapper.check_unchanged()
        report = ReshardReport(call="enter_generation", mode=self.config.mode)
        report.device_bytes_before = self.accountant.current
        self.accountant.reset_peak()
        phases = report.phase_seconds
        t = time.perf_counter()

        dev = self.device.torch_device
        for dtype, n in self._bucket_numel.items():
            self._buckets[dtype] = torch.empty(n, dtype=dtype, device=dev)
            self.accountant.alloc(n * dtype.itemsize)
        for name, p in self._placements.items():
            self._views[name] = self._buckets[p.dtype].narrow(0, p.offset, p.numel).view(p.shape)
        t = self._tick(phases, "alloc", t)

        if self.path == "stage_broadcast":
            for spec in self._stage_specs:
                if not spec.experts:
                    report.gathered_bytes += self._gather_dense(spec)
            t = self._tick(phases, "gather", t)

            for spec in self._stage_specs:
                if spec.experts:
                    report.alltoall_bytes += self._exchange_experts(spec)
            t = self._tick(phases, "experts", t)

            report.broadcast_bytes = self._broadcast_stages()
            t = self._tick(phases, "broadcast", t)
        else:
            self._param_broadcast(report)
            t = self._tick(phases, "gather_broadcast", t)

        if self.config.mode == "swap":
            if self._swapper.pool is None:  # first cycle: pinning is slow, time it apart
                self._swapper.ensure_pool()
                t = self._tick(phases, "host_pool_alloc", t)
            report.swapped_out_bytes = self._swapper.swap_out()
            t = self._tick(phases, "swap_out", t)
        return self._finish(report, ReshardState.GENERATION, dict(self._views))

    def _gathered(self, spec: ParamSpec, temps: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """All TP shards of a dense parameter as ``[src_tp, *shard]`` (a
        temporary for ``tp > 1``, a view of the update weight otherwise)."""
        src = self._update[spec.name]
        if not src.is_contiguous():
            src = self._temp(tuple(src.shape), src.dtype).copy_(src)
            temps.append(src)
        if spec.tp_dim is None or self.train.tp == 1:
            return src.unsqueeze(0), 0
        gathered = self._temp((self.train.tp, *src.shape), src.dtype)
        temps.append(gathered)
        self.coll.all_gather("tp", gathered, src)
        return gathered, gathered.nbytes

    def _slice_dense(self, spec: ParamSpec, gathered: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy this rank's generation slice out of ``[src_tp, *shard]``."""
        if spec.tp_dim is None:
            dst.copy_(gathered[0])
            return
        d = spec.tp_dim
        for seg in plan_reslice(spec.blocks, gathered.shape[0], self.gen.tp, self.gen_tp_rank):
            dst.narrow(d, seg.dst_start, seg.length).copy_(gathered[seg.src].narrow(d, seg.src_start, seg.length))

    def _gather_dense(self, spec: ParamSpec) -> int:
        """All-gather one dense parameter and copy out this rank's slice.

        The shard is gathered in chunks of its leading rows (contiguous in
        every shard), so the temporary never exceeds ``gather_chunk_bytes``
        by more than one row per TP rank.
        """
        tp = self.train.tp
        if spec.tp_dim is None or tp == 1:
            temps: list[torch.Tensor] = []
            gathered, _ = self._gathered(spec, temps)
            self._slice_dense(spec, gathered, self._views[spec.name])
            for tmp in temps:
                self._release(tmp)
            return 0
        src = self._update[spec.name]
        copy = None
        if not src.is_contiguous():
            copy = src = self._temp(tuple(src.shape), src.dtype).copy_(src)
        dst = self._views[spec.name]
        rows = src.shape[0]
        step = gather_chunk_rows(spec, self.train, self.config.gather_chunk_bytes)
        segments = plan_reslice(spec.blocks, tp, self.gen.tp, self.gen_tp_rank)
        d = spec.tp_dim
        moved = 0
        for a in range(0, rows, step):
            b = min(rows, a + step)
            gathered = self._temp((tp, b - a, *src.shape[1:]), src.dtype)
            self.coll.all_gather("tp", gathered, src.narrow(0, a, b - a))
            moved += gathered.nbytes
            if d == 0:  # the chunk covers shard rows [a, b): clip each segment to it
                for seg in segments:
                    lo, hi = max(seg.src_start, a), min(seg.src_start + seg.length, b)
                    if lo < hi:
                        dst.narrow(0, seg.dst_start + lo - seg.src_start, hi - lo).copy_(
                            gathered[seg.src].narrow(0, lo - a, hi - lo)
                        )
            else:  # rows are not split by TP: same rows of the destination
                out = dst.narrow(0, a, b - a)
                for seg in segments:
                    out.narrow(d, seg.dst_start, seg.length).copy_(
                        gathered[seg.src].narrow(d, seg.src_start, seg.length)
                    )
            self._release(gathered)
            del gathered  # drop it before the next chunk is allocated
        if copy is not None:
            self._release(copy)
        return moved

    def _param_broadcast(self, report: ReshardReport) -> None:
        """General path, for generation TP ranks that differ inside a pipeline
        group: stage by stage and one parameter at a time, the owner
        materialises the gathered parameter (dense: ``[tp, *shard]``;
        experts: all experts via an EP all-gather) in a temporary, broadcasts
        it over the PP group, and every member copies out its own slice."""
        for stage in range(self.train.pp):
            mine = stage == self.coords.pp_rank
            for spec in (s for s in self.specs if s.stage == stage):
                temps: list[torch.Tensor] = []
                dst = self._views[spec.name]
                if spec.experts:
                    shape = (spec.experts, *spec.shape)
                    if not mine:
                        buf = self._temp(shape, spec.dtype)
                        temps.append(buf)
                    elif self.train.ep > 1:
                        local = self._update[spec.name].contiguous()
                        buf = self._temp(shape, spec.dtype)
                        temps.append(buf)
                        self.coll.all_gather("ep", buf, local)
                        report.gathered_bytes += buf.nbytes
                    else:
                        buf = self._update[spec.name].contiguous()
                else:
                    if mine:
                        buf, nbytes = self._gathered(spec, temps)
                        report.gathered_bytes += nbytes
                    else:
                        rows = self.train.tp if spec.tp_dim is not None else 1
                        buf = self._temp((rows, *training_local_shape(spec, self.train)), spec.dtype)
                        temps.append(buf)
                self.coll.broadcast("pp", buf, stage)
                report.broadcast_bytes += buf.nbytes
                if spec.experts:
                    self._fill_expert_slice(spec, buf, dst, self.gen_tp_rank)
                else:
                    self._slice_dense(spec, buf, dst)
                for tmp in temps:
                    self._release(tmp)
                del buf, temps  # free before the next parameter's buffers

    def _fill_expert_slice(self, spec: ParamSpec, local: torch.Tensor, out: torch.Tensor, gen_rank: int) -> None:
        if spec.tp_dim is None:
            out.copy_(local)
            return
        d = spec.tp_dim + 1  # expert dim comes first
        for seg in plan_reslice(spec.blocks, 1, self.gen.tp, gen_rank):
            out.narrow(d, seg.dst_start, seg.length).copy_(local.narrow(d, seg.src_start, seg.length))

    def _exchange_experts(self, spec: ParamSpec) -> int:
        local = self._update[spec.name]
        dst = self._views[spec.name]
        ep = self.train.ep
        if ep == 1:
            self._fill_expert_slice(spec, local, dst, self.gen_tp_rank)
            return 0
        per_peer = (local.shape[0], *dst.shape[1:])
        send = self._temp((ep, *per_peer), spec.dtype)
        for peer, gen_rank in enumerate(self._ep_peer_gen_ranks):
            self._fill_expert_slice(spec, local, send[peer], gen_rank)
        # Peer p's chunk holds experts [p*E_local, (p+1)*E_local): exactly
        # where they belong in the [experts, ...] generation tensor.
        self.coll.all_to_all("ep", dst, send)
        self._release(send)
        return dst.nbytes

    def _broadcast_stages(self) -> int:
        if self.train.pp == 1:
            return 0
        moved = 0
        for (stage, dtype), (offset, numel) in sorted(self._regions.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            region = self._buckets[dtype].narrow(0, offset, numel)
            self.coll.broadcast("pp", region, stage)
            moved += region.nbytes
        return moved

    @torch.no_grad()
    def prefetch_update_weights(self) -> None:
        """Start bringing the update weights back while generation finishes.

        Accelerators: chunked copies on a side stream from the pinned pool.
        CPU: a plain blocking copy.  A no-op in ``"resident"`` mode or when
        already prefetched.
        """
        self._require(ReshardState.GENERATION, "prefetch_update_weights")
        report = ReshardReport(call="prefetch_update_weights", mode=self.config.mode)
        report.device_bytes_before = self.accountant.current
        self.accountant.reset_peak()
        t = time.perf_counter()
        if self.config.mode == "swap" and not self._swapper.resident:
            report.swapped_in_bytes = self._swapper.start_prefetch()
            # Issue time only: the copies overlap with whatever runs next.
            report.phase_seconds["prefetch_issue"] = time.perf_counter() - t
        self._finish(report, ReshardState.GENERATION, None)

    @torch.no_grad()
    def exit_generation(self) -> None:
        """Free the generation buckets and make the update weights resident.

        Views returned by :meth:`enter_generation` become empty (their storage
        is released even if the caller still holds them).
        """
        self._require(ReshardState.GENERATION, "exit_generation")
        report = ReshardReport(call="exit_generation", mode=self.config.mode)
        report.device_bytes_before = self.accountant.current
        self.accountant.reset_peak()
        phases = report.phase_seconds
        t = time.perf_counter()
        for dtype, bucket in self._buckets.items():
            bucket.untyped_storage().resize_(0)
            self.accountant.free(self._bucket_numel[dtype] * dtype.itemsize)
        self._buckets.clear()
        self._views.clear()
        t = self._tick(phases, "free", t)
        if self.config.mode == "swap":
            if self._swapper.prefetching:
                self._swapper.finish_prefetch()
                report.prefetched = True
                report.swapped_in_bytes = self._swapper.total_bytes
                t = self._tick(phases, "prefetch_wait", t)
            elif not self._swapper.resident:
                report.swapped_in_bytes = self._swapper.swap_in()
                t = self._tick(phases, "swap_in", t)
            else:  # prefetched on CPU: already copied synchronously
                report.prefetched = True
                report.swapped_in_bytes = self._swapper.total_bytes
        self._finish(report, ReshardState.TRAINING, None)

    def _finish(self, report: ReshardReport, state: ReshardState, result: Any) -> Any:
        report.device_bytes_after = self.accountant.current
        report.peak_device_bytes = self.accountant.peak
        report.pinned = self._swapper.pinned
        self.state = state
        self.last_report = report
        logger.info(
            "[reshard] %s rank=%d mode=%s gathered=%d alltoall=%d broadcast=%d out=%d in=%d "
            "device_bytes=%d peak=%d seconds=%.4f",
            report.call, self.rank, report.mode, report.gathered_bytes, report.alltoall_bytes,
            report.broadcast_bytes, report.swapped_out_bytes, report.swapped_in_bytes,
            report.device_bytes_after, report.peak_device_bytes, report.total_seconds,
        )
        return result

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Bring the update weights back if needed, drop the host pool and
        the groups this object created.  Idempotent."""
        if self.state is ReshardState.CLOSED:
            return
        if self.state is ReshardState.GENERATION:
            self.exit_generation()
        self._swapper.release_pool()
        if self._owns_coll:
            self.coll.close()
        if self._owns_groups:
            for group in (self.groups.tp, self.groups.pp, self.groups.ep):
                if group is not None:
                    dist.destroy_process_group(group)
        self.state = ReshardState.CLOSED

    def __enter__(self) -> AllGatherSwap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
