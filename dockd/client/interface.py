"""`DockInterface`: a `Dock` as the packages built on the client (`dockd.weights`) use it.

`Dock` imports `dockd.weights` for its weights methods (`publish_weights`, `weights_reader`), so the
weights package names this Protocol instead of `Dock`: the two would otherwise import each other.
`Dock` is one structurally; mypy checks it where a Dock is passed for one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from dockd.client.batch import Batch
from dockd.client.fetch import Fetcher
from dockd.client.lease import Lease
from dockd.client.router import Router


class DockInterface(Protocol):
    """The calls of `Dock` that `dockd.weights` makes (with the arguments it passes), its timeouts, and
    the router and fetcher that `dockd.weights.source` reads its own warehouse with."""

    connect_timeout: float
    fetch_timeout: float
    _router: Router
    _fetcher: Fetcher

    @property
    def home(self) -> int: ...

    def put(self, columns: Mapping[str, Any], *, partition: str, timeout: float | None = None,
            tags: Mapping[str, int | Sequence[int]] | None = None) -> list[int]: ...

    def acquire(self, consumer: str, columns: Sequence[str], count: int, *, partition: str,
                timeout: float | None = None, inline: bool = True, lease_timeout: float | None = None,
                where: Mapping[str, Any] | None = None) -> Lease: ...

    def read(self, partition: str, indexes: Sequence[int], columns: Sequence[str]) -> Batch: ...

    def release(self, lease: Lease) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def create_partition(self, partition: str) -> None: ...

    def set_tags(self, partition: str, indexes: Sequence[int], tags: Mapping[str, int | Sequence[int]]) -> None: ...

    def delete(self, partition: str, indexes: Sequence[int]) -> int: ...

    def seal(self, partition: str) -> None: ...

    def clear(self, partition: str) -> int: ...

    def list(self, partition: str, consumer: str | None = None, *, limit: int = 1000,
             since: str | None = None) -> dict[str, Any]: ...
