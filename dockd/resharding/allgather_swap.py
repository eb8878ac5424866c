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

import logging
from typing import Any, Literal

import torch
import torch.distributed as dist

from .collectives import Collectives, DeviceCollectives, TorchCollectives
from .device import DeviceInfo, device_of
from .errors import BackendError, LayoutError, ReshardStateError
from .generation import GenerationBuilder
from .groups import ReshardGroups, build_groups
from .layout import ParallelLayout, ParamSpec, training_local_shape, validate_layouts
from .plan import plan_buckets
from .report import PhaseClock, ReshardConfig, ReshardReport, ReshardState, log_report
from .swap import ByteAccountant, UpdateWeightSwapper

__all__ = ["AllGatherSwap", "ReshardConfig", "ReshardReport", "ReshardState"]

logger = logging.getLogger(__name__)

_HINTS = {
    ReshardState.TRAINING: "call enter_generation() first",
    ReshardState.GENERATION: "call exit_generation() first",
    ReshardState.CLOSED: "this AllGatherSwap was closed; build a new one",
}


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
        self._check_backend(collectives)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        validate_layouts(specs, train, gen, self.world_size)
        self.train, self.gen, self.specs = train, gen, list(specs)
        self.coords = train.coords(self.rank, self.world_size)
        self.gen_tp_rank = self.rank % gen.tp
        self._check_update_weights(update_weights)
        self._update = dict(update_weights)

        self._owns_groups = groups is None
        self.groups = groups if groups is not None else build_groups(train)
        self._check_groups()
        self._owns_coll = not isinstance(collectives, Collectives)
        if collectives == "torch":
            self.coll: Collectives = TorchCollectives(self.groups)
        elif collectives == "device":
            self.coll = DeviceCollectives.connect(self.groups, self.device.torch_device)
        else:
            self.coll = collectives
        self.path = self._choose_path()

        self.accountant = ByteAccountant()
        self._swapper = UpdateWeightSwapper(
            self._update, self.device, self.accountant, chunk_bytes=self.config.chunk_bytes
        )
        self.accountant.alloc(self._swapper.total_bytes)  # the update weights start resident
        self._gen = GenerationBuilder(
            specs=self.specs, update=self._update, train=train, gen=gen, stage=self.coords.pp_rank,
            gen_tp_rank=self.gen_tp_rank, ep_peer_gen_ranks=[r % gen.tp for r in self.groups.ep_ranks],
            coll=self.coll, device=self.device, accountant=self.accountant, plan=plan_buckets(self.specs, train, gen),
            path=self.path, gather_chunk_bytes=self.config.gather_chunk_bytes,
        )
        self.state = ReshardState.TRAINING
        self.last_report: ReshardReport | None = None
        logger.info(
            "[reshard] ready rank=%d device=%s mode=%s path=%s train=tp%d/pp%d/ep%d gen=tp%d "
            "update_bytes=%d gen_bytes=%d",
            self.rank, self.device.type, self.config.mode, self.path, train.tp, train.pp, train.ep,
            gen.tp, self._swapper.total_bytes, self.generation_bytes,
        )

    # ------------------------------------------------------------------ setup
    def _check_backend(self, collectives: Collectives | str) -> None:
        if collectives == "torch":
            self.device.check_backend()
        elif not dist.is_available() or not dist.is_initialized():
            raise BackendError("torch.distributed is not initialised; allgather-swap takes ranks and groups from "
                               "it (any backend will do with collectives='device')")
        if collectives == "device" and not self.device.is_accelerator:
            raise BackendError(f"collectives='device' moves weights through NCCL/HCCL, but they are on "
                               f"{self.device.type}; use collectives='torch' (gloo) for CPU weights")

    def _check_update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        stage_specs = [s for s in self.specs if s.stage == self.coords.pp_rank]
        expected = {s.name for s in stage_specs}
        missing = sorted(expected - weights.keys())
        extra = sorted(weights.keys() - expected)
        if missing or extra:
            raise LayoutError(
                f"rank {self.rank} (pipeline stage {self.coords.pp_rank}) must pass exactly the "
                f"update weights of its stage; missing={missing[:8]} unexpected={extra[:8]}"
            )
        for spec in stage_specs:
            t = weights[spec.name]
            want = training_local_shape(spec, self.train)
            if tuple(t.shape) != want or t.dtype != spec.dtype:
                raise LayoutError(
                    f"update weight {spec.name!r} on rank {self.rank} is {tuple(t.shape)} "
                    f"{t.dtype}; the training layout needs {want} {spec.dtype}"
                )

    def _check_groups(self) -> None:
        train = self.train
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

    def _choose_path(self) -> Literal["stage_broadcast", "param_broadcast"]:
        # Fast path: all members of a pipeline group share one generation TP
        # rank, so each stage's finished buckets can simply be broadcast.
        if len({r % self.gen.tp for r in self.groups.pp_ranks}) == 1:
            return "stage_broadcast"
        logger.info(
            "[reshard] path=param_broadcast: generation tp=%d does not divide the %d ranks of a "
            "training stage, so full parameters are broadcast over the pipeline group one at a time",
            self.gen.tp, self.train.tp * self.train.dp(self.world_size),
        )
        return "param_broadcast"

    # ------------------------------------------------------------- properties
    @property
    def generation_bytes(self) -> int:
        """Bytes of the generation buckets (all dtypes, with alignment)."""
        return self._gen.plan.nbytes

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
        return dict(self._gen.views)

    def _require(self, state: ReshardState, call: str) -> None:
        if self.state is not state:
            raise ReshardStateError(f"{call}() needs state {state.value}, but it is {self.state.value}: "
                                    f"{_HINTS[self.state]}")

    def _begin(self, call: str) -> ReshardReport:
        report = ReshardReport(call=call, mode=self.config.mode)
        report.device_bytes_before = self.accountant.current
        self.accountant.reset_peak()
        return report

    # ------------------------------------------------------------ generation
    @torch.no_grad()
    def enter_generation(self) -> dict[str, torch.Tensor]:
        """Build the generation weights; returns ``name -> tensor`` views into
        the buckets (valid until :meth:`exit_generation`)."""
        self._require(ReshardState.TRAINING, "enter_generation")
        self._swapper.check_unchanged()
        report = self._begin("enter_generation")
        clock = PhaseClock(self.device, report.phase_seconds)
        self._gen.allocate()
        clock.lap("alloc")
        self._gen.build(report, clock)
        if self.config.mode == "swap":
            if self._swapper.pool is None:  # first cycle: pinning is slow, time it apart
                self._swapper.ensure_pool()
                clock.lap("host_pool_alloc")
            report.swapped_out_bytes = self._swapper.swap_out()
            clock.lap("swap_out")
        return self._finish(report, ReshardState.GENERATION, dict(self._gen.views))

    @torch.no_grad()
    def prefetch_update_weights(self) -> None:
        """Start bringing the update weights back while generation finishes.

        Accelerators: chunked copies on a side stream from the pinned pool.
        CPU: a plain blocking copy.  A no-op in ``"resident"`` mode or when
        already prefetched.
        """
        self._require(ReshardState.GENERATION, "prefetch_update_weights")
        report = self._begin("prefetch_update_weights")
        clock = PhaseClock(self.device, report.phase_seconds)
        if self.config.mode == "swap" and not self._swapper.resident:
            report.swapped_in_bytes = self._swapper.start_prefetch()
            clock.issued("prefetch_issue")  # issue time only: the copies overlap with whatever runs next
        self._finish(report, ReshardState.GENERATION, None)

    @torch.no_grad()
    def exit_generation(self) -> None:
        """Free the generation buckets and make the update weights resident.

        Views returned by :meth:`enter_generation` become empty (their storage
        is released even if the caller still holds them).
        """
        self._require(ReshardState.GENERATION, "exit_generation")
        report = self._begin("exit_generation")
        clock = PhaseClock(self.device, report.phase_seconds)
        self._gen.free()
        clock.lap("free")
        if self.config.mode == "swap":
            if self._swapper.prefetching:
                self._swapper.finish_prefetch()
                report.prefetched = True
                report.swapped_in_bytes = self._swapper.total_bytes
                clock.lap("prefetch_wait")
            elif not self._swapper.resident:
                report.swapped_in_bytes = self._swapper.swap_in()
                clock.lap("swap_in")
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
        log_report(report, self.rank)
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
