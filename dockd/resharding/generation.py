"""Building the generation weights from the training shards: the buckets, and the collectives
that fill them (TP all-gather, EP all-to-all, PP broadcast, or the per-parameter broadcast)."""

from __future__ import annotations

from typing import Literal

import torch

from .collectives import Collectives
from .device import DeviceInfo
from .layout import ParallelLayout, ParamSpec, gather_chunk_rows, plan_reslice, training_local_shape
from .plan import BucketPlan
from .report import PhaseClock, ReshardReport
from .swap import ByteAccountant

__all__ = ["GenerationBuilder"]


class GenerationBuilder:
    """The generation buckets of one rank and how they are filled.

    ``update`` maps this rank's stage's parameter names to its training shards (read only);
    ``rank`` is this rank's coordinates: ``stage`` (its pipeline stage), ``gen_tp_rank`` and
    the generation TP rank of every EP peer. Every device byte it allocates is charged to
    ``accountant``.
    """

    def __init__(
        self,
        *,
        specs: list[ParamSpec],
        update: dict[str, torch.Tensor],
        train: ParallelLayout,
        gen: ParallelLayout,
        stage: int,
        gen_tp_rank: int,
        ep_peer_gen_ranks: list[int],
        coll: Collectives,
        device: DeviceInfo,
        accountant: ByteAccountant,
        plan: BucketPlan,
        path: Literal["stage_broadcast", "param_broadcast"],
        gather_chunk_bytes: int | None,
    ) -> None:
        self.specs, self.train, self.gen = specs, train, gen
        self.stage, self.gen_tp_rank, self.ep_peer_gen_ranks = stage, gen_tp_rank, ep_peer_gen_ranks
        self.coll, self.device, self.accountant = coll, device, accountant
        self.plan, self.path, self.gather_chunk_bytes = plan, path, gather_chunk_bytes
        self._update = update
        self._stage_specs = [s for s in specs if s.stage == stage]
        self.buckets: dict[torch.dtype, torch.Tensor] = {}
        self.views: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------ buckets
    def allocate(self) -> None:
        self.buckets, self.views = self.plan.allocate(self.device.torch_device)
        self.accountant.alloc(self.plan.nbytes)

    def free(self) -> None:
        """Release the buckets' storage (views the caller still holds become empty)."""
        for dtype, bucket in self.buckets.items():
            bucket.untyped_storage().resize_(0)
            self.accountant.free(self.plan.numel[dtype] * dtype.itemsize)
        self.buckets.clear()
        self.views.clear()

    def build(self, report: ReshardReport, clock: PhaseClock) -> None:
        """Fill the allocated buckets, adding the bytes moved to ``report`` and timing the phases."""
        if self.path == "stage_broadcast":
            for spec in self._stage_specs:
                if not spec.experts:
                    report.gathered_bytes += self._gather_dense(spec)
            clock.lap("gather")
            for spec in self._stage_specs:
                if spec.experts:
                    report.alltoall_bytes += self._exchange_experts(spec)
            clock.lap("experts")
            report.broadcast_bytes = self._broadcast_stages()
            clock.lap("broadcast")
        else:
            self._param_broadcast(report)
            clock.lap("gather_broadcast")

    # ------------------------------------------------------------ temporaries
    def _temp(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device.torch_device)
        self.accountant.alloc(t.nbytes)
        return t

    def _release(self, t: torch.Tensor) -> None:
        """Account a temporary as freed; the caller drops its references so
        that the allocator really gets the memory back."""
        self.accountant.free(t.nbytes)

    # ------------------------------------------------------------ dense parameters
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
            self._slice_dense(spec, gathered, self.views[spec.name])
            for tmp in temps:
                self._release(tmp)
            return 0
        src = self._update[spec.name]
        copy = None
        if not src.is_contiguous():
            copy = src = self._temp(tuple(src.shape), src.dtype).copy_(src)
        dst = self.views[spec.name]
        rows = src.shape[0]
        step = gather_chunk_rows(spec, self.train, self.gather_chunk_bytes)
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

    # ------------------------------------------------------------ experts
    def _fill_expert_slice(self, spec: ParamSpec, local: torch.Tensor, out: torch.Tensor, gen_rank: int) -> None:
        if spec.tp_dim is None:
            out.copy_(local)
            return
        d = spec.tp_dim + 1  # expert dim comes first
        for seg in plan_reslice(spec.blocks, 1, self.gen.tp, gen_rank):
            out.narrow(d, seg.dst_start, seg.length).copy_(local.narrow(d, seg.src_start, seg.length))

    def _exchange_experts(self, spec: ParamSpec) -> int:
        local = self._update[spec.name]
        dst = self.views[spec.name]
        ep = self.train.ep
        if ep == 1:
            self._fill_expert_slice(spec, local, dst, self.gen_tp_rank)
            return 0
        per_peer = (local.shape[0], *dst.shape[1:])
        send = self._temp((ep, *per_peer), spec.dtype)
        for peer, gen_rank in enumerate(self.ep_peer_gen_ranks):
            self._fill_expert_slice(spec, local, send[peer], gen_rank)
        # Peer p's chunk holds experts [p*E_local, (p+1)*E_local): exactly
        # where they belong in the [experts, ...] generation tensor.
        self.coll.all_to_all("ep", dst, send)
        self._release(send)
        return dst.nbytes

    # ------------------------------------------------------------ pipeline stages
    def _broadcast_stages(self) -> int:
        if self.train.pp == 1:
            return 0
        moved = 0
        for stage, dtype, offset, numel in self.plan.stage_regions():
            region = self.buckets[dtype].narrow(0, offset, numel)
            self.coll.broadcast("pp", region, stage)
            moved += region.nbytes
        return moved

    def _param_broadcast(self, report: ReshardReport) -> None:
        """General path, for generation TP ranks that differ inside a pipeline
        group: stage by stage and one parameter at a time, the owner
        materialises the gathered parameter (dense: ``[tp, *shard]``;
        experts: all experts via an EP all-gather) in a temporary, broadcasts
        it over the PP group, and every member copies out its own slice."""
        for stage in range(self.train.pp):
            for spec in (s for s in self.specs if s.stage == stage):
                temps: list[torch.Tensor] = []
                buf = self._broadcast_source(spec, stage == self.stage, temps, report)
                self.coll.broadcast("pp", buf, stage)
                report.broadcast_bytes += buf.nbytes
                if spec.experts:
                    self._fill_expert_slice(spec, buf, self.views[spec.name], self.gen_tp_rank)
                else:
                    self._slice_dense(spec, buf, self.views[spec.name])
                for tmp in temps:
                    self._release(tmp)
                del buf, temps  # free before the next parameter's buffers

    def _broadcast_source(self, spec: ParamSpec, mine: bool, temps: list[torch.Tensor],
                          report: ReshardReport) -> torch.Tensor:
        """The tensor one parameter is broadcast in: the gathered parameter on its own stage's
        ranks, an empty one of the same shape on the others (temporaries go to ``temps``)."""
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
            return buf
        if mine:
            buf, nbytes = self._gathered(spec, temps)
            report.gathered_bytes += nbytes
            return buf
        rows = self.train.tp if spec.tp_dim is not None else 1
        buf = self._temp((rows, *training_local_shape(spec, self.train)), spec.dtype)
        temps.append(buf)
        return buf
