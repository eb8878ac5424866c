"""The collectives allgather-swap runs over its TP, PP and EP groups.

Three operations, each on one group named by its dimension (``"tp"``,
``"pp"``, ``"ep"``), on tensors viewed as bytes:

- ``all_gather(dim, out, inp)``: ``out`` is the group members' ``inp``
  concatenated in group order;
- ``broadcast(dim, t, src)``: in place, from the member at position ``src``
  of the group (its stage, for the PP group);
- ``all_to_all(dim, out, inp)``: member ``p`` receives chunk ``p`` of every
  member's ``inp`` (equal chunks), in group order.

:class:`TorchCollectives` runs them on ``torch.distributed`` process groups
(gloo, NCCL or HCCL, whatever the groups were made with).
:class:`DeviceCollectives` runs them on dockd's own NCCL/HCCL bindings
(:mod:`dockd.device`), one communicator per group, enqueued on the
current stream: ``torch.distributed`` then only carries the communicators'
unique ids once, when they are made (or not at all, when the caller passes
communicators it made itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dockd.device import Communicator

from .errors import BackendError
from .groups import ReshardGroups

__all__ = ["Collectives", "DeviceCollectives", "TorchCollectives"]

DIMS = ("tp", "pp", "ep")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Collectives:
    """What allgather-swap needs from a collective backend (see the module docstring)."""

    def __init__(self, groups: ReshardGroups) -> None:
        self.ranks = {"tp": groups.tp_ranks, "pp": groups.pp_ranks, "ep": groups.ep_ranks}

    def all_gather(self, dim: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        raise NotImplementedError

    def broadcast(self, dim: str, t: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def all_to_all(self, dim: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Free what this object made (a no-op by default)."""


class TorchCollectives(Collectives):
    """On the ``torch.distributed`` groups of ``groups`` (``groups.tp`` etc.)."""

    def __init__(self, groups: ReshardGroups) -> None:
        super().__init__(groups)
        self.groups = {"tp": groups.tp, "pp": groups.pp, "ep": groups.ep}

    def all_gather(self, dim: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(as_bytes(out), as_bytes(inp), group=self.groups[dim])

    def broadcast(self, dim: str, t: torch.Tensor, src: int) -> None:
        dist.broadcast(as_bytes(t), src=self.ranks[dim][src], group=self.groups[dim])

    def all_to_all(self, dim: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_to_all_single(as_bytes(out), as_bytes(inp), group=self.groups[dim])


class DeviceCollectives(Collectives):
    """On :class:`dockd.device.Communicator` objects, one per group of more than one rank.

    ``comms`` maps ``"tp"``/``"pp"``/``"ep"`` to an initialised communicator whose
    ranks are the group's positions (``comms["pp"].rank`` is this rank's stage).
    :meth:`connect` makes them over the ``torch.distributed`` groups instead.
    """

    def __init__(self, groups: ReshardGroups, comms: dict, *, owned: bool = False) -> None:
        super().__init__(groups)
        for dim in DIMS:
            ranks = self.ranks[dim]
            comm = comms.get(dim)
            if len(ranks) == 1:
                continue
            if comm is None or not comm.initialized:
                raise BackendError(f"DeviceCollectives needs an initialised communicator for the {dim} group "
                                   f"{ranks} (comms[{dim!r}])")
            if comm.world != len(ranks):
                raise BackendError(f"the {dim} communicator has {comm.world} ranks but the {dim} group is {ranks}")
        self.comms = dict(comms)
        self._owned = owned

    @classmethod
    def connect(cls, groups: ReshardGroups, device: torch.device, *, library_path: str | None = None,
                ) -> DeviceCollectives:
        """Make one communicator per group (NCCL for CUDA, HCCL for NPU): the group's first
        member makes the unique id and ``broadcast_object_list`` over the group's
        ``torch.distributed`` group hands it to the others. Every rank must call this."""
        comms: dict = {}
        try:
            for dim in DIMS:
                ranks = getattr(groups, f"{dim}_ranks")
                if len(ranks) == 1:
                    continue
                group = getattr(groups, dim)
                if group is None:
                    raise BackendError(f"the {dim} group {ranks} has no torch.distributed group to agree "
                                       "on a unique id over; pass communicators (DeviceCollectives(groups, comms))")
                comm = Communicator.for_device(device, library_path=library_path)
                me = ranks.index(dist.get_rank())
                box = [comm.unique_id() if me == 0 else None]
                dist.broadcast_object_list(box, src=ranks[0], group=group)
                uid = box[0]
                assert uid is not None  # the first member's, broadcast to all
                comms[dim] = comm.init(uid, me, len(ranks), device=device.index)
        except BaseException:
            for comm in comms.values():
                comm.abort()
            raise
        return cls(groups, comms, owned=True)

    def all_gather(self, dim: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comms[dim].all_gather(as_bytes(out), as_bytes(inp))

    def broadcast(self, dim: str, t: torch.Tensor, src: int) -> None:
        self.comms[dim].broadcast(as_bytes(t), src)

    def all_to_all(self, dim: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        comm = self.comms[dim]
        n, me = comm.world, comm.rank
        src, dst = as_bytes(inp), as_bytes(out)
        if src.numel() != dst.numel() or src.numel() % n:
            raise BackendError(f"all_to_all over {n} ranks needs equal input and output sizes divisible by "
                               f"{n}; got {src.numel()} and {dst.numel()} bytes")
        chunk = src.numel() // n
        dst[me * chunk : (me + 1) * chunk].copy_(src[me * chunk : (me + 1) * chunk])
        with comm.group():  # every pair both sends and receives: one fused launch
            for p in range(n):
                if p != me:
                    comm.send(src[p * chunk : (p + 1) * chunk], p)
                    comm.recv(dst[p * chunk : (p + 1) * chunk], p)

    def close(self) -> None:
        if self._owned:
            comms, self.comms = self.comms, {}
            for comm in comms.values():
                comm.destroy()
