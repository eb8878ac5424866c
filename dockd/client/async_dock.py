"""`AsyncDock`: the same methods as `Dock`, awaitable.

Each call runs the blocking client on a thread of the dock's own pool (sockets
release the GIL while they wait), so a coroutine waiting in `get` never blocks
the event loop. Cancelling a waiting `get` closes only the connection that get
waits on (the controller drops the waiter); a lease granted at that moment is
released, not fetched, so nothing is taken for a get nobody will receive.

Each method is derived from `Dock`'s (`awaitable`): its signature and
documentation are written once, on `Dock`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dockd.client.dock import Dock
from dockd.client.scope import CallScope


def _twin(method: Callable) -> Callable[[Callable], Callable]:
    """Give an AsyncDock coroutine function `method`'s name, documentation and signature (without its
    private parameters), so that help(), inspect.signature and the API docs show Dock's."""

    def dress(fn: Callable) -> Callable:
        fn = functools.wraps(method)(fn)
        fn.__qualname__ = f"AsyncDock.{method.__name__}"
        sig = inspect.signature(method)
        fn.__signature__ = sig.replace(  # type: ignore[attr-defined]  # a function takes any attribute
            parameters=[p for p in sig.parameters.values() if not p.name.startswith("_")])
        del fn.__wrapped__  # (inspect would follow it back to Dock's, private parameters and all)
        return fn

    return dress


def awaitable(method: Callable, *, cancellable: bool = False) -> Callable:
    """`Dock.method` as an AsyncDock method: the same call, run on the dock's thread pool. With
    `cancellable`, cancelling the coroutine closes the connections the call waits on (its CallScope)."""
    if not cancellable:
        @_twin(method)
        async def call(self: AsyncDock, *args, **kwargs):
            return await self._run(method, self.dock, *args, **kwargs)

        return call

    @_twin(method)
    async def scoped(self: AsyncDock, *args, **kwargs):
        scope = CallScope()
        task = asyncio.ensure_future(self._run(method, self.dock, *args, _scope=scope, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            scope.cancel()
            task.add_done_callback(_consume)  # its DockClosed is expected; never "exception was never retrieved"
            raise

    return scoped


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

    put = awaitable(Dock.put)
    """[`Dock.put`][dockd.Dock.put], awaitable."""
    get = awaitable(Dock.get, cancellable=True)
    """[`Dock.get`][dockd.Dock.get], awaitable. Cancelling it closes only the connection it waits on; a lease granted
    at that moment is released, not fetched."""
    acquire = awaitable(Dock.acquire)
    """[`Dock.acquire`][dockd.Dock.acquire], awaitable."""
    fetch = awaitable(Dock.fetch)
    """[`Dock.fetch`][dockd.Dock.fetch], awaitable."""
    read = awaitable(Dock.read)
    """[`Dock.read`][dockd.Dock.read], awaitable."""
    confirm = awaitable(Dock.confirm)
    """[`Dock.confirm`][dockd.Dock.confirm], awaitable."""
    extend = awaitable(Dock.extend)
    """[`Dock.extend`][dockd.Dock.extend], awaitable."""
    release = awaitable(Dock.release)
    """[`Dock.release`][dockd.Dock.release], awaitable."""
    clear = awaitable(Dock.clear)
    """[`Dock.clear`][dockd.Dock.clear], awaitable."""
    create_partition = awaitable(Dock.create_partition)
    """[`Dock.create_partition`][dockd.Dock.create_partition], awaitable."""
    set_version = awaitable(Dock.set_version)
    """[`Dock.set_version`][dockd.Dock.set_version], awaitable."""
    list = awaitable(Dock.list)
    """[`Dock.list`][dockd.Dock.list], awaitable."""
    ping = awaitable(Dock.ping)
    """[`Dock.ping`][dockd.Dock.ping], awaitable."""
    delete = awaitable(Dock.delete)
    """[`Dock.delete`][dockd.Dock.delete], awaitable."""
    drop_consumer = awaitable(Dock.drop_consumer)
    """[`Dock.drop_consumer`][dockd.Dock.drop_consumer], awaitable."""
    seal = awaitable(Dock.seal)
    """[`Dock.seal`][dockd.Dock.seal], awaitable."""
    reserve = awaitable(Dock.reserve)
    """[`Dock.reserve`][dockd.Dock.reserve], awaitable."""
    set_tags = awaitable(Dock.set_tags)
    """[`Dock.set_tags`][dockd.Dock.set_tags], awaitable."""
    save = awaitable(Dock.save)
    """[`Dock.save`][dockd.Dock.save], awaitable."""
    load = awaitable(Dock.load)
    """[`Dock.load`][dockd.Dock.load], awaitable."""
    publish_weights = awaitable(Dock.publish_weights)
    """[`Dock.publish_weights`][dockd.Dock.publish_weights], awaitable."""
    weights_reader = awaitable(Dock.weights_reader)
    """[`Dock.weights_reader`][dockd.Dock.weights_reader], awaitable (registering goes to the dock); the reader
    it gives is the blocking one."""
    stats = awaitable(Dock.stats)
    """[`Dock.stats`][dockd.Dock.stats], awaitable."""

    async def close(self) -> None:
        """Close the dock (see Dock.close: what its gets returned is confirmed first, on the dock's
        thread pool, so the event loop goes on meanwhile) and its thread pool. An AsyncDock never
        closed confirms them as its Dock is collected or the interpreter exits, as a Dock does."""
        try:
            await self._run(self.dock.close)
        finally:
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
