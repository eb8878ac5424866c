"""A warehouse as the controller's membership knows it: its address, its instance, its state
(see `membership`), its connection, and what of it the journal and clients see."""

from __future__ import annotations

import dataclasses

from dockd._proto import dockd_pb2 as pb
from dockd.controller.clock import Timer
from dockd.net.peer import Peer
from dockd.terms import DURABLE


@dataclasses.dataclass(slots=True, eq=False)
class WarehouseEntry:
    id: int
    host: str
    port: int
    capacity: int
    unix: str = ""
    instance: int = 0
    state: str = "joined"
    peer: Peer | None = None  # its connection; None while away, and for the one hosted in this process
    local: bool = False
    timer: Timer | None = None
    beat_sent: float | None = None  # clock time the unanswered heartbeat went out (None: none outstanding)

    @property
    def alive(self) -> bool:
        """A connected member: requests to it go over its connection (an unresponsive one answers
        them once it runs again), and its commits are taken."""
        return self.state in ("joined", "unresponsive")

    @property
    def durable(self) -> bool:
        """It keeps its data in a data dir: a restart (same instance) brings its samples back."""
        return bool(self.instance & DURABLE)

    @property
    def reachable(self) -> bool:
        """Its data can still be read: joined, or away but not given up on."""
        return self.state in ("joined", "unresponsive", "rejoining")

    @property
    def connected(self) -> bool:
        """Its connection is open (the controller's own warehouse always is)."""
        return self.local or (self.peer is not None and not getattr(self.peer, "closed", False))

    def key(self) -> tuple:
        """What `info` shows of it (but `used`)."""
        return self.id, self.host, self.port, self.capacity, self.unix, self.state, self.instance

    def info(self, used: int = 0) -> pb.WarehouseInfo:
        # clients see an unresponsive warehouse as not alive: they do not choose it for their puts
        return pb.WarehouseInfo(id=self.id, host=self.host, port=self.port, alive=self.state == "joined",
                                capacity=self.capacity, used=used, unix=self.unix, state=self.state,
                                durable=self.durable)

    def record(self) -> dict:
        # unresponsive is a passing state of a joined member: a restarted controller waits for its rejoin
        return {"id": self.id, "host": self.host, "port": self.port, "capacity": self.capacity, "unix": self.unix,
                "instance": self.instance, "state": "joined" if self.state == "unresponsive" else self.state}
