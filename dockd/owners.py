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

A hot partition (one async-RL stream of the whole cluster) can be spread over
several controllers: ``--shards NAME=S`` on every controller makes partition
NAME the union of S shards, each an ordinary partition named
``shard_name(NAME, k, S)`` and owned by the controller after NAME's own by k
places, so S <= K shards land on S different controllers. The shards are part
of the dock's identity as the list is (compared with it). Clients do the
spreading (dockd.client.spread); daemons only route each shard to its owner.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence

from dockd.errors import DockConfigError, DockValueError

SHARD_MARK = "~shard-"
"""What separates a spread partition's name from its shard's place in a shard's name."""


def shard_name(partition: str, k: int, count: int) -> str:
    """The name of shard k (of `count`) of spread partition `partition`."""
    return f"{partition}{SHARD_MARK}{k}-of-{count}"


def shard_of(name: str) -> tuple[str, int, int] | None:
    """(partition, k, count) when `name` is a shard's name (`shard_name`), else None."""
    at = name.rfind(SHARD_MARK)
    if at <= 0:
        return None
    k, sep, count = name[at + len(SHARD_MARK):].partition("-of-")
    if not sep or not k.isdigit() or not count.isdigit() or int(k) >= int(count):
        return None
    return name[:at], int(k), int(count)


def owner_index(partition: str, count: int) -> int:
    """Index, among `count` controllers, of the one that owns `partition` (0 when there is one).
    Shard k of a spread partition: k places after the one that owns the spread partition's name."""
    if count <= 1:
        return 0
    if SHARD_MARK in partition:
        shard = shard_of(partition)
        if shard is not None:
            return (owner_index(shard[0], count) + shard[1]) % count
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


def parse_shards(text: str) -> dict[str, int]:
    """--shards NAME=S,NAME=S,...: each spread partition and its shard count (the counts are checked
    against the controllers by `check_shards`)."""
    out: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        name, sep, count = item.rpartition("=")
        if not sep or not name or not count.isdigit():
            raise DockValueError(f"--shards: {item!r} is not NAME=COUNT (e.g. --shards rollouts=4: partition "
                                 "'rollouts' spread over 4 controllers; the same on every controller)")
        if SHARD_MARK in name:
            raise DockValueError(f"--shards: partition name {name!r} holds {SHARD_MARK!r}, which names shards")
        if name in out:
            raise DockValueError(f"--shards names partition {name!r} twice")
        out[name] = int(count)
    return out


def check_shards(shards: Mapping[str, int], controllers: int) -> None:
    """Every spread partition on 2 to `controllers` shards: one shard per controller."""
    for name, count in shards.items():
        if not 2 <= count <= controllers:
            raise DockValueError(f"--shards {name}={count}: a partition is spread over 2 to {controllers} shards "
                                 f"with {controllers} controllers (--controllers), one shard per controller")


def shard_names(shards: Mapping[str, int]) -> list[str]:
    """The spread partitions as they travel and are compared: "name=count", sorted by name."""
    return [f"{name}={count}" for name, count in sorted(shards.items())]


def shards_from(names: Sequence[str]) -> dict[str, int]:
    """The spread partitions from their wire form (`shard_names`)."""
    out = {}
    for item in names:
        name, _, count = item.rpartition("=")
        out[name] = int(count)
    return out


def own_index(controllers: Sequence[str], host: str, port: int, advertise: str = "") -> int:
    """This controller's place in the list, from the address it listens on (or advertises). A list that
    names it twice (its --host and its --advertise, or two spellings of loopback) is refused: each entry
    owns partitions of its own, and those of the second would go to this controller under another name."""
    mine = {f"{h}:{port}" for h in (advertise, host) if h}
    for k, addr in enumerate(controllers):
        if addr in mine:
            again = [a for a in controllers if a != addr and names_this_node(a, host, port, advertise)]
            if again:
                raise DockValueError(
                    f"--controllers {','.join(controllers)} names this controller twice ({addr} and "
                    f"{' and '.join(again)}): give each controller once, at the address the others reach it by")
            return k
    raise DockValueError(
        f"--controllers {','.join(controllers)} does not name this controller ({' or '.join(sorted(mine))}): "
        "give each controller the full list with its own address among them, and a fixed --port"
    )


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a daemon on this machine."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def names_this_node(address: str, host: str, port: int, advertise: str = "") -> bool:
    """Whether HOST:PORT `address` reaches the node listening on `host`:`port` (advertised as
    `advertise`): that host or name, or loopback by any spelling when the node listens on loopback
    or on every address."""
    other, _, other_port = address.rpartition(":")
    if not other_port.isdigit() or int(other_port) != port:
        return False
    other = other.strip("[]")
    if other in (host.strip("[]"), advertise.strip("[]")):
        return True
    return is_loopback(other) and (is_loopback(host) or host.strip("[]") in ("0.0.0.0", "::", ""))


def differs(mine: Sequence[str], theirs: Sequence[str], my_shards: Sequence[str] = (),
            their_shards: Sequence[str] = ()) -> bool:
    """Whether two daemons' controller lists (or spread partitions, as `shard_names` gives them) disagree.
    An empty list is a dock of one controller, which agrees with a list naming only that one (a
    warehouse that learned it from the controller)."""
    if list(my_shards) != list(their_shards):
        return True
    if len(mine) <= 1 and len(theirs) <= 1:
        return False
    return tuple(mine) != tuple(theirs)


def disagreement(mine: Sequence[str], mine_where: str, theirs: Sequence[str], theirs_where: str,
                 my_shards: Sequence[str] = (), their_shards: Sequence[str] = ()) -> str:
    """What a refusal says: both lists (and spread partitions, when those differ), and the fix."""
    if not differs(mine, theirs) and list(my_shards) != list(their_shards):
        return (f"the dock's controllers disagree on its spread partitions: {mine_where} has --shards "
                f"{','.join(my_shards) or '(none)'}, {theirs_where} has {','.join(their_shards) or '(none)'}. "
                "Every controller needs the same --shards (it decides which controller owns each shard): restart "
                "the one that is wrong with the right --shards; the dock refuses service until they agree")
    return (f"the dock's daemons disagree on its controllers: {mine_where} has --controllers "
            f"{','.join(mine) or '(none: one controller)'}, {theirs_where} has "
            f"{','.join(theirs) or '(none: one controller)'}. Every controller needs the same list in the same "
            "order (it decides which controller owns each partition): restart the one that is wrong with the "
            "right --controllers; the dock refuses service until they agree")


LIST_FILE = "controllers.json"
"""The file in a controller's state dir naming the controller list (and this controller's place in it)
under which the dir keeps its partitions."""


def record_list(state_dir: str, controllers: Sequence[str], own: str) -> None:
    """Remember in `state_dir` the list this controller (`own`, "" for a dock's only one) keeps its
    partitions under: the dock agreed on it (one controller agrees with itself). Best effort: a dir that
    cannot be written is reported by the journal."""
    path = os.path.join(state_dir, LIST_FILE)
    try:
        os.makedirs(state_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps({"controllers": list(controllers), "own": own}) + "\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def check_recorded(state_dir: str, controllers: Sequence[str], own: str) -> None:
    """Refuse to start a controller on a state dir kept under another controller list (`record_list`): its
    partitions would belong to other controllers, which know nothing of them."""
    path = os.path.join(state_dir, LIST_FILE)
    try:
        with open(path, "rb") as f:
            recorded = json.loads(f.read())
        then, then_own = list(recorded["controllers"]), str(recorded["own"])
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DockValueError(f"--state-dir {state_dir}: cannot read {path} ({e}); it names the controller list the "
                             "dir was kept under: restore it, or remove it to keep the list given now") from None
    if then == list(controllers) and then_own == own:
        return

    def said(listed: Sequence[str], at: str) -> str:
        return f"--controllers {','.join(listed)} (as {at})" if listed else "one controller (no --controllers)"

    raise DockConfigError(
        f"--state-dir {state_dir} was kept by a controller started with {said(then, then_own)}; this one has "
        f"{said(controllers, own)}. Another list moves partitions to other owners, which know nothing of those "
        "this dir holds. Start it with the list it had, or, to change the dock's controllers, stop all of them "
        f"and start each on a new --state-dir (move the old ones aside; {LIST_FILE} there names the list)")
