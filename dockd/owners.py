"""Several controllers: which one owns a partition.

A dock may run its metadata plane on K controller processes (``dockd serve
--controller --controllers A,B,...`` on each, the same list everywhere). Each
partition belongs to one of them, chosen from its name alone, so that clients,
warehouses and controllers agree without asking anyone: the owner of
``partition`` is ``controllers[owner_index(partition, K)]``. Everything about
a partition (its samples, consumers, leases, tags, seal, checkpoints) lives on
its owner, journaled in the owner's --state-dir; a controller that is down
stalls only the partitions it owns.

One controller numbers a new warehouse, which presents the id it got to the
others, so a warehouse id means the same everywhere (clients keep one
warehouse table): controller k numbers with ids k, k + K, k + 2K, ..., so any
controller that answers can number one (a new warehouse is not kept out by
one that is down) and no two give the same id.

The list is part of the dock's identity: changing it (adding a controller,
reordering) moves partitions to other owners, so it must stay the same across
restarts of a dock whose controllers keep state. Daemons and clients compare it
whenever they meet (`differs`), and a dock whose controllers disagree refuses
service (dockd.controller.agreement) rather than split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dockd.errors import DockValueError


def owner_index(partition: str, count: int) -> int:
    """Index, among `count` controllers, of the one that owns `partition` (0 when there is one)."""
    if count <= 1:
        return 0
    digest = hashlib.blake2b(partition.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % count


def parse(text: str) -> tuple[str, ...]:
    """--controllers HOST:PORT,HOST:PORT,...: the addresses in order, checked."""
    out = []
    for item in text.split(","):
        item = item.strip()
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DockValueError(f"--controllers: {item!r} is not HOST:PORT (give every controller's address, "
                                 "comma-separated, the same list on each controller)")
        out.append(f"{host}:{int(port)}")
    if len(set(out)) != len(out):
        raise DockValueError(f"--controllers names an address twice: {','.join(out)}")
    return tuple(out)


def own_index(controllers: Sequence[str], host: str, port: int, advertise: str = "") -> int:
    """This controller's place in the list, from the address it listens on (or advertises)."""
    mine = {f"{h}:{port}" for h in (advertise, host) if h}
    for k, addr in enumerate(controllers):
        if addr in mine:
            return k
    raise DockValueError(
        f"--controllers {','.join(controllers)} does not name this controller ({' or '.join(sorted(mine))}): "
        "give each controller the full list with its own address among them, and a fixed --port"
    )


def differs(mine: Sequence[str], theirs: Sequence[str]) -> bool:
    """Whether two daemons' controller lists disagree. An empty list is a dock of one controller,
    which agrees with a list naming only that one (a warehouse that learned it from the controller)."""
    if len(mine) <= 1 and len(theirs) <= 1:
        return False
    return tuple(mine) != tuple(theirs)


def disagreement(mine: Sequence[str], mine_where: str, theirs: Sequence[str], theirs_where: str) -> str:
    """What a refusal says: both lists, and the fix."""
    return (f"the dock's daemons disagree on its controllers: {mine_where} has --controllers "
            f"{','.join(mine) or '(none: one controller)'}, {theirs_where} has "
            f"{','.join(theirs) or '(none: one controller)'}. Every controller needs the same list in the same "
            "order (it decides which controller owns each partition): restart the one that is wrong with the "
            "right --controllers; the dock refuses service until they agree")
