"""Checks of a client call's arguments, and the request fields they become.

Every check raises DockTypeError or DockValueError saying what was expected,
before anything is sent: a bad argument never costs a round trip.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dockd import limits
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockTypeError, DockValueError

_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64 = (1 << 64) - 1


def split_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str):
        raise DockTypeError(f"address must be a 'host:port' string, got {type(address).__name__}")
    scheme, sep, rest = address.partition("://")
    if sep:  # (refused here: looking the scheme up as a host name would take the whole connect timeout)
        raise DockValueError(f"address must be 'host:port' without a scheme: dockd speaks its own protocol, not "
                             f"{scheme}; got {address!r}, use {rest.rstrip('/')!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DockValueError(f"address must look like 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def seconds(timeout: Any, what: str = "timeout") -> float | None:
    """A timeout as seconds (None, or infinity: no limit); refuses what is not a number >= 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise DockTypeError(f"{what} is a number of seconds or None, got {timeout!r}")
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise DockValueError(f"{what} must be >= 0 seconds or None (no limit), got {timeout!r}")
    return None if t > limits.MAX_TIMEOUT else t  # (infinity, or past a year: no limit)


def positive_seconds(name: str, v: Any, *, finite: bool = True, env: str = "") -> float:
    """A setting in seconds: a number > 0 (finite unless `finite` is False; inf: no limit). `env`: the
    environment variable it came from, named in the error."""
    where = f" (from ${env})" if env else ""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise DockTypeError(f"{name}{where} is a number of seconds, got {v!r}")
    t = float(v)
    if not t > 0 or (finite and math.isinf(t)):
        raise DockValueError(f"{name}{where} must be a {'finite ' if finite else ''}number of seconds > 0, got {v!r}")
    return t


def whole(name: str, v: Any, lo: int = 0, what: str = "", hi: int = _INT64[1]) -> int:
    """An int in [lo, hi] (numpy ints too, bools never); hi defaults to the largest int64."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
        raise DockValueError(f"{name} must be an int >= {lo}{what}, got {v!r}")
    if v > hi:
        raise DockValueError(f"{name} must be an int from {lo} to {hi}{what} (the wire's range), got {v!r}")
    return int(v)


def positive_count(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise DockValueError(f"{name} must be a positive int, got {v!r}")
    return v


def check_partition(partition: str) -> None:
    if not isinstance(partition, str) or not partition:
        raise DockValueError(f"partition must be a non-empty string such as 'step-0', got {partition!r}")
    text(partition, "partition name")


def text(name: str, what: str) -> None:
    """Names travel as UTF-8: a string with a lone surrogate (from bytes decoded with
    surrogateescape, or a bad slice of an emoji) has no UTF-8 form."""
    try:
        name.encode()
    except UnicodeEncodeError:
        raise DockValueError(f"{what} {name!r} is not valid text (it holds a lone surrogate); names are UTF-8 "
                             "strings") from None


def consumer_and_columns(consumer: str, columns: Sequence[str]) -> None:
    if not isinstance(consumer, str) or not consumer:
        raise DockValueError(f"consumer must be a non-empty string such as 'actor_train', got {consumer!r}")
    if (isinstance(columns, str) or not isinstance(columns, (list, tuple, Sequence)) or not columns
            or not all(isinstance(c, str) for c in columns)):
        raise DockTypeError(f"columns must be a non-empty list of column names, got {columns!r}")
    if len(set(columns)) != len(columns):
        raise DockValueError(f"columns contains duplicates: {list(columns)}")
    try:
        "".join((consumer, *columns)).encode()  # (one encode for all: a lone surrogate has no UTF-8 form anywhere)
    except UnicodeEncodeError:
        for name in (consumer, *columns):
            text(name, "consumer or column name")


def int_list(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, (str, bytes)):
        raise DockTypeError(f"{name} must be a sequence of ints")
    try:
        arr = np.asarray(values)
    except Exception:
        raise DockTypeError(f"{name} must be a sequence of ints") from None
    if arr.ndim == 1 and arr.dtype.kind in "ufO" and arr.size:  # ints past int64 make numpy pick these
        big = [x for x in (arr.tolist() if arr.dtype.kind == "u" else list(values))
               if isinstance(x, (int, np.integer)) and not isinstance(x, bool) and not _INT64[0] <= x <= _INT64[1]]
        if big:
            raise DockValueError(f"{name} must hold 64-bit signed ints (from {_INT64[0]} to {_INT64[1]}), got "
                                 f"{big[0]!r}")
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise DockTypeError(f"{name} must be a flat sequence of ints, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64).tolist()


def tag_list(tags: Mapping[str, Any], n: int) -> list[pb.Tag]:
    if not isinstance(tags, Mapping):
        raise DockTypeError(f"tags must be a dict of tag name -> int or list of ints, got {type(tags).__name__}")
    out = []
    for name, v in tags.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise DockValueError(f"a tag name is an identifier such as 'age', got {name!r}")
        single = isinstance(v, (int, np.integer)) and not isinstance(v, bool)
        values = [whole(f"tag {name!r}", v, _INT64[0])] if single else int_list(f"tag {name!r}", v)
        if len(values) not in (1, n):
            raise DockValueError(f"tag {name!r} has {len(values)} values for {n} samples; give one, or one per sample")
        out.append(pb.Tag(name=name, values=[int(x) for x in values]))
    return out


def where_list(where: Mapping[str, Any]) -> list[pb.TagRange]:
    if not isinstance(where, Mapping):
        raise DockTypeError(f"where must be a dict of tag name -> value or (lo, hi), got {type(where).__name__}")
    out = []
    for name, rng in where.items():
        if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
            lo = hi = whole(f"where[{name!r}]", rng, _INT64[0])
        elif isinstance(rng, (tuple, list)) and len(rng) == 2:
            lo = _INT64[0] if rng[0] is None else whole(f"where[{name!r}]'s lo", rng[0], _INT64[0])
            hi = _INT64[1] if rng[1] is None else whole(f"where[{name!r}]'s hi", rng[1], _INT64[0])
        else:
            raise DockTypeError(f"where[{name!r}] must be an int or a (lo, hi) pair (None: open end), got {rng!r}")
        if lo > hi:
            raise DockValueError(f"where[{name!r}] = {rng!r} matches nothing: give lo <= hi")
        out.append(pb.TagRange(name=name, lo=lo, hi=hi))
    return out


def rank_fields(req: pb.AcquireRequest, dp_rank, dp_size, mp_group, step, balance_by) -> None:
    """Fill an acquire's rank-aware fields (see Dock.get)."""
    if dp_size is None and dp_rank is not None:
        raise DockValueError("dp_rank needs dp_size (the number of data-parallel ranks)")
    if dp_size is None and mp_group is None:
        if step is not None or balance_by:
            raise DockValueError("step and balance_by belong to rank-aware gets: pass dp_rank and dp_size "
                                 "(or mp_group)")
        return
    if dp_size is not None:
        req.dp_size = whole("dp_size", dp_size, 1)
        if dp_rank is None:
            if mp_group is None:
                raise DockValueError("a rank-aware get needs dp_rank (this rank, 0..dp_size-1) with dp_size")
            dp_rank = mp_group[0]
        req.dp_rank = whole("dp_rank", dp_rank, 0)
        if req.dp_rank >= req.dp_size:
            raise DockValueError(f"dp_rank must be below dp_size={req.dp_size}, got {req.dp_rank}")
    else:
        req.dp_size, req.dp_rank = 1, 0
    if mp_group is not None:
        if not isinstance(mp_group, (tuple, list)) or len(mp_group) != 3:
            raise DockTypeError(f"mp_group is (group_id, rank_in_group, group_size), got {mp_group!r}")
        gid, rank, size = (whole(n, v, lo) for n, v, lo in
                           (("mp_group's group_id", mp_group[0], 0), ("mp_group's rank", mp_group[1], 0),
                            ("mp_group's size", mp_group[2], 1)))
        if rank >= size or size > 64:
            raise DockValueError(f"mp_group needs 0 <= rank_in_group < group_size <= 64, got {mp_group!r}")
        if dp_size is not None and gid != req.dp_rank:
            raise DockValueError(f"with dp_size, mp_group's group_id is the group's data-parallel rank "
                                 f"({req.dp_rank}), got {gid}")
        req.mp_rank, req.mp_size = rank, size
        if dp_size is None:
            req.mp_group = gid
    if step is not None:
        req.has_step, req.step = True, whole("step", step, 0)
    if balance_by:
        names = [balance_by] if isinstance(balance_by, str) else balance_by
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise DockTypeError(f"balance_by names tags or columns, got {balance_by!r}")
        req.balance_by.extend(names)


def acquire_options(req: pb.AcquireRequest, *, seed, where, max_staleness, order_by, lease_timeout) -> None:
    """Fill an acquire's optional fields (see Dock.get and Dock.acquire)."""
    if seed is not None:
        req.has_seed, req.seed = True, whole("seed", seed, 0, hi=_UINT64)
    if where:
        req.where.extend(where_list(where))
    if max_staleness is not None:
        if (not isinstance(max_staleness, (int, np.integer)) or isinstance(max_staleness, bool)
                or max_staleness < 0):
            raise DockValueError(f"max_staleness is an int >= 0 (policy versions behind the trainer's), "
                                 f"got {max_staleness!r}")
        req.max_staleness = int(max_staleness) + 1
    if order_by:
        if not isinstance(order_by, str):
            raise DockTypeError(f"order_by names a tag such as 'age' (or '-age' for largest first), got {order_by!r}")
        req.order_by = order_by
    if lease_timeout is not None:
        if not 0 < lease_timeout <= 7 * 86400:
            raise DockValueError(f"lease_timeout must be in (0, one week] seconds, got {lease_timeout}")
        req.lease_seconds = float(lease_timeout)


def version_tag(version: Any, tags: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A put's tags with its policy version added as the reserved tag "version"."""
    if version is None:
        return tags
    if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or not 0 <= version <= _INT64[1]:
        raise DockValueError(f"version is the policy version that produced the samples, an int from 0 to "
                             f"{_INT64[1]} (a 64-bit tag), got {version!r}")
    if tags and "version" in tags:
        raise DockValueError("give the policy version as version=..., or as tags={'version': ...}, not both")
    return {**(tags or {}), "version": int(version)}


def create_partition(group_size, retire_when_consumed_by, max_staleness, retire_stale,
                     max_pending) -> pb.CreatePartition:
    retire = ([retire_when_consumed_by] if isinstance(retire_when_consumed_by, str)
              else list(retire_when_consumed_by))
    if not all(isinstance(c, str) and c for c in retire):
        raise DockTypeError(f"retire_when_consumed_by lists consumer names, got {retire_when_consumed_by!r}")
    positive_count("group_size", group_size)
    for name, v in (("max_staleness", max_staleness), ("max_pending", max_pending)):
        if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0):
            raise DockValueError(f"{name} must be an int >= 0 or None, got {v!r}")
    if retire_stale and max_staleness is None:
        raise DockValueError("retire_stale=True needs max_staleness: it deletes samples staler than that")
    return pb.CreatePartition(
        group_size=group_size, retire_when_consumed_by=retire, retire_stale=bool(retire_stale),
        max_staleness=0 if max_staleness is None else int(max_staleness) + 1, max_pending=int(max_pending or 0))


def list_samples(consumer, where, limit, start, since=None) -> pb.ListSamples:
    if consumer is not None and (not isinstance(consumer, str) or not consumer):
        raise DockValueError(f"consumer must be a non-empty string or None, got {consumer!r}")
    for name, v in (("limit", limit), ("start", start)):
        whole(name, v, 0)
    if since is not None:
        if not isinstance(since, str):
            raise DockValueError(f"since must be a cursor an earlier dock.list handed out ('cursor'), or '' to "
                                 f"list from the start, got {since!r}")
        if consumer is not None or start:
            raise DockValueError("list(since=...) lists every sample changed since the cursor: it takes neither "
                                 "consumer nor start")
    op = pb.ListSamples(consumer=consumer or "", limit=min(int(limit), limits.MAX_SAMPLES) or 1, start=int(start),
                        changes=since is not None, since=since or "")
    if where:
        op.where.extend(where_list(where))
    return op


def abs_dir(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise DockTypeError(f"path must be a directory name, got {path!r}")
    return os.path.abspath(os.fspath(path))


def device(device) -> Any:
    """The torch device a get's results go to (None: leave them where they are), checked here."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DockValueError(f"device={device!r} is not a device name such as 'cuda:0': {e}") from None
    if dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        if backend is None or not backend.is_available():
            raise DockValueError(f"device={device!r}, but this process has no {dev.type} device "
                                 f"(torch.{dev.type}.is_available() is False)")
    return dev
