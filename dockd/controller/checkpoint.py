"""Checkpoints of partitions: `save` writes a partition to a directory every daemon can reach
(its metadata from the controller, one Arrow IPC file per warehouse holding its data), `load`
restores one under a name, each file to the warehouse of the same id if it is live, else to
another live one."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import numpy as np

from dockd._proto import dockd_pb2 as pb
from dockd._version import __version__
from dockd.controller.core import Controller
from dockd.controller.journal import Journal
from dockd.controller.membership import Membership
from dockd.controller.warehouse_calls import WarehouseCalls
from dockd.errors import DockDataLost, DockNotFound, DockStateFull, DockValueError

logger = logging.getLogger(__name__)


class Checkpoints:
    """Saves and loads under `root` ("": anywhere), the files written and read by the warehouses
    (`calls`); a loaded partition is journaled, and the gets waiting on it are woken (`wake`)."""

    def __init__(self, core: Controller, members: Membership, journal: Journal | None, calls: WarehouseCalls, *,
                 root: str, wake: Callable[[str], None]) -> None:
        self.core = core
        self.members = members
        self.journal = journal
        self.calls = calls
        self.root = root
        self.wake = wake
        self.loading: set[str] = set()  # partitions a load is filling

    async def save(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Write a partition to a directory every daemon can reach: its metadata (this controller)
        and one Arrow IPC file per warehouse holding its data (the warehouses, in parallel)."""
        name, path = req.partition, req.save.path
        _check_dir(path, self.root)
        meta = self.core.export_partition(name)
        part = self.core.partitions[name]
        n = part.size
        held = set()
        for loc in part.loc.values():
            held.update(np.unique(loc[:n][loc[:n] < 0xFFFE]).tolist())
        for wid in sorted(held):
            entry = self.members.get(wid)
            if entry is None or not entry.alive:
                raise DockDataLost(f"cannot save partition {name!r}: warehouse {wid}, which holds some of its data, "
                                   "is not reachable; save once it is back, or delete what it held")
        files = {wid: f"warehouse-{wid}.arrow" for wid in sorted(held)}
        dump = self.calls.dump
        replies = await asyncio.gather(*(dump(wid, pb.DumpRequest(partition=name, path=os.path.join(path, f)))
                                         for wid, f in files.items()))
        meta = {"format": "dockd-checkpoint", "version": 1, "dockd": __version__, "partition": meta,
                "files": [[wid, f] for wid, f in files.items()]}
        await asyncio.get_running_loop().run_in_executor(None, _write_meta, path, meta)
        out = pb.PartitionReply(samples=n - part.deleted, nbytes=sum(r.nbytes for r in replies))
        logger.info("[controller] partition saved partition=%s path=%s samples=%d bytes=%d warehouses=%d", name, path,
                    out.samples, out.nbytes, len(files))
        return out

    async def load(self, req: pb.PartitionRequest) -> pb.PartitionReply:
        """Restore a partition saved by `save`, under req.partition: each warehouse file goes to the
        warehouse of the same id if it is live, else to another live one."""
        name, path = req.partition, req.load.path
        _check_dir(path, self.root)
        meta = await asyncio.get_running_loop().run_in_executor(None, _read_meta, path)
        if name in self.core.partitions or name in self.loading:
            raise DockValueError(f"partition {name!r} exists (or is being loaded); clear it or load the checkpoint "
                                 "under another name")
        if self.journal is not None:
            self.journal.room()
        self.loading.add(name)
        try:
            return await self._load(name, path, meta)
        finally:
            self.loading.discard(name)

    async def _load(self, name: str, path: str, meta: dict) -> pb.PartitionReply:
        live = sorted(e.id for e in self.members.entries.values() if e.alive)
        if meta["files"] and not live:
            raise DockValueError("no live warehouse to load the checkpoint into")
        targets, k = {}, 0
        for wid, _ in meta["files"]:
            if wid in live:
                targets[wid] = wid
            else:  # spread the files of warehouses that are not here over the live ones
                targets[wid] = live[k % len(live)]
                k += 1
        d = meta["partition"]
        limit = d["size"]
        try:
            replies = await asyncio.gather(*(self.calls.dump(targets[wid], pb.DumpRequest(
                partition=name, path=os.path.join(path, f), load=True, limit=limit))
                for wid, f in meta["files"]))
        except BaseException:
            await self.calls.free_everywhere(name)  # (a warehouse that ran out of room: nothing half-loaded stays)
            raise
        self.core.import_partition(d, name, targets)
        part = self.core.partitions[name]
        for (wid, _), r in zip(meta["files"], replies):
            part.nbytes[targets[wid]] = part.nbytes.get(targets[wid], 0) + r.nbytes
        if self.journal is not None:
            try:
                self.journal.loaded(name, self.core.export_partition(name))
            except DockStateFull:
                del self.core.partitions[name]  # not recorded: not loaded
                await self.calls.free_everywhere(name)
                raise
        out = pb.PartitionReply(samples=limit - part.deleted, nbytes=sum(r.nbytes for r in replies))
        logger.info("[controller] partition loaded partition=%s path=%s samples=%d bytes=%d", name, path,
                    out.samples, out.nbytes)
        self.wake(name)
        return out


_META = "partition.msgpack"


def _check_dir(path: str, root: str = "") -> None:
    if not path or not os.path.isabs(path):
        raise DockValueError(f"a checkpoint path is an absolute directory every daemon of the dock can reach, "
                             f"got {path!r}")
    if root:
        real, top = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, top]) != top:
            raise DockValueError(f"checkpoints of this dock live under {root} (--checkpoint-root); {path} is not "
                                 "below it")


def _regular(path: str) -> str:
    """`path`, if it names a regular file (a FIFO or a device would block or never end a read)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as e:
        raise DockValueError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise DockValueError(f"{path} is not a regular file; a checkpoint holds regular files only")
    return path


def _write_meta(path: str, meta: dict) -> None:
    import msgpack

    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, _META + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(meta, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, _META))


def _read_meta(path: str) -> dict:
    import msgpack

    _check_dir(path)
    try:
        with open(_regular(os.path.join(path, _META)), "rb") as f:
            meta = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        raise DockNotFound(f"{path} holds no dockd checkpoint ({_META} is missing); save one with "
                           "dock.save(partition, path)") from None
    if not isinstance(meta, dict) or meta.get("format") != "dockd-checkpoint":
        raise DockValueError(f"{os.path.join(path, _META)} is not a dockd checkpoint")
    if meta.get("version") != 1:
        raise DockValueError(f"checkpoint format version {meta.get('version')!r} in {path} is not supported by "
                             f"dockd {__version__}")
    for entry in meta.get("files") or ():  # file names inside the checkpoint directory, nothing else
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)
                and entry[1] == os.path.basename(entry[1]) and entry[1] not in ("", ".", "..")):
            raise DockValueError(f"{os.path.join(path, _META)} names a file outside its directory: {entry!r}")
    return meta
