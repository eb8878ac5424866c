"""Small asyncio helpers of the daemon: background work kept referenced, and ready-made failures."""

from __future__ import annotations

import asyncio

from dockd._proto import dockd_pb2 as pb

_tasks: set[asyncio.Task] = set()


def spawn(coro) -> None:
    """Run `coro` in the background (referenced until it ends, so it is not collected mid-way)."""
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def failed(exc: BaseException) -> asyncio.Future:
    """A future that has failed with `exc`."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


async def reply_when_done(peer, frame, work, field: str) -> None:
    """Answer `frame` with the awaited outcome of `work` in reply field `field` (or its error)."""
    try:
        out = await work
    except Exception as e:
        peer.reply_error(frame, e)
    else:
        peer.reply(frame, pb.Frame(**{field: out}))
