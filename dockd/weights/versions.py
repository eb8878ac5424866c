"""The version table of a model's weights: names, manifest records, and which versions go (pure).

A model's weights live in three kinds of partitions:

    dockd.weights/<model>/v<N>     version N: one sample per bucket (column "data", flat uint8)
    dockd.weights/<model>          the manifest: one sample per *complete* version (column
                                   "manifest": its index and settings; tags "wv" = N and "t" =
                                   when it was published, ms since the epoch)
    dockd.weights/<model>/readers  the registered readers: one sample per reader (column
                                   "reader": its name; tags "taken" = the newest version it
                                   finished reading, -1 before any, and "seen" = when, ms)

The manifest sample is put only once every bucket of the version is stored: that put is the
ready fence. A version nobody fenced (a trainer killed mid-publish) is invisible and is cleared
by the next publish. `retirable` decides which complete versions go: all but the newest `keep`,
each once no registered reader holds it back. A reader holds version v back while it has not
finished reading v or a newer one, for at most `hold` seconds after v was published (a reader
that has not taken it by then stops holding it back). A version that a kept delta version is
built on is kept with it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dockd.errors import DockValueError

PREFIX = "dockd.weights/"
VERSION_TAG = "wv"
TIME_TAG = "t"
BASE_TAG = "wb"  # a delta version: the version it is built on (-1: a whole one)
TAKEN_TAG = "taken"
SEEN_TAG = "seen"
MAX_VERSION = (1 << 62) - 1
WAIT_CONSUMER = "dockd.weights.wait"
"""The one consumer of a manifest: a waiting reader leases the version it waits for and gives it back
at once, so that any number of readers wait without a consumer name each."""


def check_model(model: str) -> str:
    if not isinstance(model, str) or not model or "/" in model or model != model.strip():
        raise DockValueError(f"model must be a non-empty name without '/' or surrounding spaces, got {model!r}")
    return model


def check_version(version: Any, what: str = "version") -> int:
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise DockValueError(f"{what} must be an int in 0..2**62-1, got {version!r}")
    return version


def manifest_partition(model: str) -> str:
    return PREFIX + check_model(model)


def readers_partition(model: str) -> str:
    return f"{manifest_partition(model)}/readers"


def version_partition(model: str, version: int) -> str:
    return f"{manifest_partition(model)}/v{check_version(version)}"


def version_of(model: str, partition: str) -> int | None:
    """The version a partition of `model` holds (None: not one of its version partitions)."""
    m = re.fullmatch(re.escape(manifest_partition(model)) + r"/v(\d+)", partition)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True, slots=True)
class Version:
    """A complete version as the manifest lists it."""

    version: int
    index: int          # its sample in the manifest
    published_ms: int
    base: int = -1      # a delta version: the version it is built on


@dataclasses.dataclass(frozen=True, slots=True)
class Reader:
    name: str
    index: int          # its sample in the readers partition
    taken: int          # newest version it finished reading (-1: none)
    seen_ms: int


def versions_of(listing: Mapping[str, Any]) -> list[Version]:
    """The manifest's versions from `Dock.list` of it, oldest first."""
    tags = listing["tags"]
    vs, ts = tags.get(VERSION_TAG, []), tags.get(TIME_TAG, [])
    bs = tags.get(BASE_TAG) or [-1] * len(vs)
    out = [Version(int(v), int(i), int(t), int(b)) for i, v, t, b in zip(listing["indexes"], vs, ts, bs)]
    return sorted(out, key=lambda x: x.version)


def readers_of(listing: Mapping[str, Any], names: Mapping[int, str] | None = None) -> list[Reader]:
    """The registered readers from `Dock.list` of the readers partition (`names`: index -> name, if read)."""
    tags = listing["tags"]
    taken, seen = tags.get(TAKEN_TAG, []), tags.get(SEEN_TAG, [])
    names = names or {}
    return [Reader(names.get(int(i), ""), int(i), int(k), int(s)) for i, k, s in zip(listing["indexes"], taken, seen)]


def newest(versions: Sequence[Version], at_least: int = 0) -> Version | None:
    best = max((v for v in versions if v.version >= at_least), key=lambda v: v.version, default=None)
    return best


def holders(v: Version, readers: Iterable[Reader], *, hold_ms: int, now_ms: int) -> list[Reader]:
    """The readers that hold `v` back: registered, not past it, and within `hold_ms` of its publication."""
    if now_ms - v.published_ms >= hold_ms:
        return []
    return [r for r in readers if r.taken < v.version]


def retirable(versions: Sequence[Version], readers: Sequence[Reader], *, keep: int, hold_ms: int, now_ms: int,
              bases: Mapping[int, int] | None = None) -> list[Version]:
    """The complete versions to retire now: not among the newest `keep`, held back by no reader, and
    not the base of a version that stays (`bases`: delta version -> the version it is built on;
    default: the versions' own `base`)."""
    if keep < 1:
        raise DockValueError(f"keep must be >= 1 (the newest version is always kept), got {keep}")
    order = sorted(versions, key=lambda v: v.version)
    stay = {v.version for v in order[-keep:]}
    stay |= {v.version for v in order[:-keep] if holders(v, readers, hold_ms=hold_ms, now_ms=now_ms)}
    if bases is None:
        bases = {v.version: v.base for v in versions if v.base >= 0}
    frontier = list(stay)
    while frontier:  # the bases of what stays stay, transitively
        b = bases.get(frontier.pop())
        if b is not None and b not in stay:
            stay.add(b)
            frontier.append(b)
    return [v for v in order if v.version not in stay]


def stale_readers(readers: Sequence[Reader], *, hold_ms: int, now_ms: int) -> list[Reader]:
    """Registrations of readers not seen for 16 holds: they hold nothing back, and go from the table."""
    return [r for r in readers if now_ms - r.seen_ms > 16 * hold_ms]


def abandoned(model: str, partitions: Iterable[str], complete: Iterable[int], publishing: int) -> list[str]:
    """Version partitions of `model` that no manifest record fences (a publish that died) other than
    the one being published now."""
    done = set(complete)
    out = []
    for p in partitions:
        v = version_of(model, p)
        if v is not None and v not in done and v != publishing:
            out.append(p)
    return out
