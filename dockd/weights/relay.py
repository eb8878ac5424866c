"""Relay planning: who pulls a version of a model's weights from whom (pure).

The warehouse a version was published to (its *origin*) plans its relay. Each warehouse that
serves a reader joins once and is told its *parent*: the origin, or a warehouse that joined
before it. The parent sends it each bucket as soon as it holds that bucket itself, so buckets
flow down the tree in a pipeline, and the origin's link carries each byte `fanout` times
however many warehouses read (once for a chain, the default: where every link has the same
rate, a chain of N warehouses takes about (1 + (N - 1) / buckets) times one transfer, a tree
about `fanout` times one transfer per level).

A parent is chosen as the earliest warehouse in join order (the origin first) that has fewer than
`fanout` live children and is not the joiner itself or below it (a warehouse whose parent failed
joins again, keeping the warehouses below it, so none of them may become its parent).
"""

from __future__ import annotations

from dockd.errors import DockValueError


class RelayPlan:
    """The relay tree of one version at its origin warehouse."""

    def __init__(self, origin: int, fanout: int = 1) -> None:
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
            raise DockValueError(f"fanout must be an int >= 1 (children per warehouse; 1: a chain), got {fanout!r}")
        self.origin = origin
        self.fanout = fanout
        self.order: list[int] = [origin]
        self.parent: dict[int, int] = {}
        self.failed: set[int] = set()

    def join(self, wid: int, failed_parent: int | None = None) -> int:
        """The parent `wid` pulls from (the same one again while it is live). `failed_parent`: the
        parent it had stopped answering; it gets another, and nobody is sent to the failed one."""
        if wid == self.origin:
            raise DockValueError(f"warehouse {wid} is this version's origin: it holds every bucket already")
        if failed_parent is not None and failed_parent != self.origin:
            self.failed.add(failed_parent)
        self.failed.discard(wid)  # (it is back: it asks)
        current = self.parent.get(wid)
        if current is not None and current not in self.failed and current != failed_parent:
            return current
        if wid not in self.order:
            self.order.append(wid)
        banned = self.below(wid) | self.failed | {wid}
        for h in self.order:
            if h not in banned and self.children(h) < self.fanout:
                self.parent[wid] = h
                return h
        self.parent[wid] = self.origin  # (every holder is full: the origin takes one more)
        return self.origin

    def children(self, wid: int) -> int:
        return sum(1 for c, p in self.parent.items() if p == wid and c not in self.failed)

    def below(self, wid: int) -> set[int]:
        """The warehouses that pull from `wid`, directly or through others."""
        out: set[int] = set()
        frontier = [wid]
        while frontier:
            w = frontier.pop()
            for c, p in self.parent.items():
                if p == w and c not in out:
                    out.add(c)
                    frontier.append(c)
        return out

    def depth(self, wid: int) -> int:
        """Hops from the origin (0: the origin)."""
        d = 0
        seen = set()
        while wid != self.origin:
            if wid in seen or wid not in self.parent:
                raise DockValueError(f"warehouse {wid} has not joined this relay")
            seen.add(wid)
            wid = self.parent[wid]
            d += 1
        return d
