"""Checkpoints of partitions (`dockd.controller.checkpoint`), Checkpoints driven directly with its real
collaborators (a controller core, a journal in a temporary state dir, membership, warehouse calls) and
a fake of the warehouse in the controller's process that records the files it is asked to write and
read: a save writes the partition's metadata and asks each warehouse holding its data for its file, a
load restores it under another name (journaled, the gets waiting on it woken), and paths outside the
checkpoint root are refused."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.controller.checkpoint import Checkpoints
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockValueError
from dockd.terms import CommitOutcome
from tests.unit.controller.fakes import Journaled


class Hosted:
    """The warehouse in the controller's process: the dump requests it got."""

    def __init__(self) -> None:
        self.dumps: list[pb.DumpRequest] = []

    async def dump(self, req: pb.DumpRequest) -> pb.DumpReply:
        self.dumps.append(req)
        return pb.DumpReply(samples=3, nbytes=24)

    def free(self, partition: str, indexes: np.ndarray | None = None) -> int:
        return 0


class Saved(Journaled):
    """Checkpoints under `root`, over partition "p" of 3 samples on the hosted warehouse."""

    def __init__(self, state_dir, root: str) -> None:
        super().__init__(state_dir)
        members, timers = self.members, self.timers
        reg = pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30, instance=7)
        self.wid = members.register(None, reg, lambda req: CommitOutcome()).id
        self.core.commit("p", ["x"], warehouse=self.wid, new_count=3, nbytes=24)
        self.hosted = Hosted()
        calls = WarehouseCalls(self.core, members, self.hosted, timers, daemon_timeout=1.0)
        self.woken: list[str] = []
        self.checkpoints = Checkpoints(self.core, members, self.journal, calls, root=root, wake=self.woken.append)


def test_a_saved_partition_loads_under_another_name_from_the_files_its_warehouses_wrote(tmp_path):
    async def main():
        s = Saved(tmp_path / "state", str(tmp_path))
        path = str(tmp_path / "ckpt")
        out = await s.checkpoints.save(pb.PartitionRequest(partition="p", save=pb.SavePartition(path=path)))
        assert (out.samples, out.nbytes) == (3, 24) and os.path.exists(os.path.join(path, "partition.msgpack"))
        (dumped,) = s.hosted.dumps
        assert (dumped.partition, dumped.path, dumped.load) == ("p", os.path.join(path, f"warehouse-{s.wid}.arrow"),
                                                               False)
        out = await s.checkpoints.load(pb.PartitionRequest(partition="q", load=pb.LoadPartition(path=path)))
        loaded = s.hosted.dumps[-1]
        assert (loaded.partition, loaded.path, loaded.load, loaded.limit) == ("q", dumped.path, True, 3)
        assert out.samples == 3 and s.core.partitions["q"].size == 3 and s.woken == ["q"]
        assert not s.checkpoints.loading
        assert s.restarted().partitions["q"].size == 3  # (the load was journaled)

    asyncio.run(main())


def test_checkpoints_live_under_their_root_and_a_load_never_replaces_a_partition(tmp_path):
    async def main():
        s = Saved(tmp_path / "state", str(tmp_path / "root"))
        for path, why in ((str(tmp_path / "elsewhere"), "is not below it"), ("relative", "an absolute directory")):
            with pytest.raises(DockValueError, match=why):
                await s.checkpoints.save(pb.PartitionRequest(partition="p", save=pb.SavePartition(path=path)))
        path = str(tmp_path / "root" / "ckpt")
        await s.checkpoints.save(pb.PartitionRequest(partition="p", save=pb.SavePartition(path=path)))
        with pytest.raises(DockValueError, match="exists"):
            await s.checkpoints.load(pb.PartitionRequest(partition="p", load=pb.LoadPartition(path=path)))
        assert len(s.hosted.dumps) == 1 and s.woken == []

    asyncio.run(main())
