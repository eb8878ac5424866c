"""`AsyncDock`: the same methods as `Dock`, awaitable.

Each call runs the blocking client on a thread of the dock's own pool (sockets
release the GIL while they wait), so a coroutine waiting in `get` never blocks
the event loop. Cancelling a waiting `get` closes only the connection that get
waits on (the controller drops the waiter); a lease granted at that moment is
released, not fetched, so nothing is taken for a get nobody will receive.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dockd.client.batch import Batch
from dockd.client.dock import Dock, Lease
from dockd.client.router import CallScope


class AsyncDock:
    """The awaitable twin of `Dock`: the same methods, each run on a thread of its own pool.
    Get one with `await dockd.connect_async(address)`."""

    def __init__(self, dock: Dock, executor: ThreadPoolExecutor) -> None:
        self.dock = dock
        self._executor = executor

    @property
    def address(self) -> str:
        return self.dock.address

    async def _run(self, fn, /, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def put(self, columns: Mapping[str, Any], *, partition: str, indexes: Sequence[int] | None = None,
                  group_size: int = 1, timeout: float | None = None,
                  tags: Mapping[str, int | Sequence[int]] | None = None, device: str | None = None,
                  version: int | None = None) -> list[int]:
        return await self._run(self.dock.put, columns, partition=partition, indexes=indexes, group_size=group_size,
                               timeout=timeout, tags=tags, device=device, version=version)

    async def get(self, consumer: str, columns: Sequence[str], count: int, *, partition: str, timeout: float | None = None,
                  groups: bool = False, allow_partial: bool = False, shuffle: bool = False, seed: int | None = None,
                  **rank_and_tags) -> Batch:
        """As Dock.get (rank_and_tags: dp_rank, dp_size, mp_group, step, balance_by, where, order_by,
        max_staleness, prefer_local, device)."""
        scope = CallScope()
        fut = self._run(self.dock.get, consumer, columns, count, partition=partition, timeout=timeout, groups=groups,
                        allow_partial=allow_partial, shuffle=shuffle, seed=seed, _scope=scope, **rank_and_tags)
        task = asyncio.ensure_future(fut)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            scope.cancel()
            task.add_done_callback(_consume)  # its DockClosed is expected; never "exception was never retrieved"
            raise

    async def acquire(self, consumer: str, columns: Sequence[str], count: int, *, partition: str,
                      timeout: float | None = None, **kwargs) -> Lease:
        return await self._run(self.dock.acquire, consumer, columns, count, partition=partition, timeout=timeout,
                               **kwargs)

    async def fetch(self, lease: Lease) -> dict[str, list[Any]]:
        return await self._run(self.dock.fetch, lease)

    async def confirm(self, lease: Lease) -> None:
        await self._run(self.dock.confirm, lease)

    async def release(self, lease: Lease) -> int:
        return await self._run(self.dock.release, lease)

    async def extend(self, lease: Lease, seconds: float | None = None) -> float:
        return await self._run(self.dock.extend, lease, seconds)

    async def read(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> Batch:
        return await self._run(self.dock.read, partition, indexes, columns)

    async def clear(self, partition: str) -> int:
        return await self._run(self.dock.clear, partition)

    async def create_partition(self, partition: str, **options) -> None:
        await self._run(self.dock.create_partition, partition, **options)

    async def delete(self, partition: str, indexes: Sequence[int]) -> int:
        return await self._run(self.dock.delete, partition, indexes)

    async def seal(self, partition: str) -> None:
        await self._run(self.dock.seal, partition)

    async def reserve(self, partition: str, count: int, *, group_size: int = 1) -> list[int]:
        return await self._run(self.dock.reserve, partition, count, group_size=group_size)

    async def set_tags(self, partition: str, indexes: Sequence[int], tags: Mapping[str, Any]) -> None:
        await self._run(self.dock.set_tags, partition, indexes, tags)

    async def set_version(self, partition: str, version: int) -> int:
        return await self._run(self.dock.set_version, partition, version)

    async def list(self, partition: str, consumer: str | None = None, **kwargs) -> dict[str, Any]:
        return await self._run(self.dock.list, partition, consumer, **kwargs)

    async def ping(self) -> float:
        return await self._run(self.dock.ping)

    async def save(self, partition: str, path) -> dict[str, int]:
        return await self._run(self.dock.save, partition, path)

    async def load(self, path, *, partition: str) -> dict[str, int]:
        return await self._run(self.dock.load, path, partition=partition)

    async def stats(self, *, traffic: bool = False) -> dict[str, Any]:
        return await self._run(functools.partial(self.dock.stats, traffic=traffic))

    async def close(self) -> None:
        self.dock.close()
        self._executor.shutdown(wait=False)

    async def __aenter__(self) -> AsyncDock:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Async{self.dock!r}"


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def connect_async(address: str, *, max_concurrency: int = 64, **kwargs) -> AsyncDock:
    """Connect to a dock from asyncio code; see `dockd.connect` for the arguments."""
    executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="dockd-async")
    try:
        dock = await asyncio.get_running_loop().run_in_executor(executor, functools.partial(Dock, address, **kwargs))
    except BaseException:
        executor.shutdown(wait=False)
        raise
    return AsyncDock(dock, executor)
