"""`dockd status ADDRESS`: what a dock holds and how its consumers keep up.

One snapshot is `Dock.stats(traffic=True)` with the time it was taken; two
snapshots give each warehouse's bytes in and out per second. The view is drawn
with rich: warehouses (address, state, used of capacity, traffic, how each serves remote
readers: "socket" or "mooncake"), then per
partition each consumer's progress (taken of the partition's samples, with
what it could take now, holds under lease and waits for), the slowest
consumer marked; with max_pending, how many samples each consumer that puts
wait for has yet to take, the one furthest behind marked. At a narrow console
the less important columns are left out; addresses, states and consumer names
are never cut.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dockd.errors import DockError

#: Partitions drawn (the most recently created); `--json` has all of them.
MAX_PARTITIONS = 12


def snapshot(dock) -> dict[str, Any]:
    snap = dock.stats(traffic=True)
    snap["time"] = time.time()
    return snap


def with_rates(cur: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any]:
    """Add `in_per_s`/`out_per_s` to each warehouse answering in both snapshots."""
    if prev is None:
        return cur
    dt = cur["time"] - prev["time"]
    for wid, w in cur["warehouses"].items():
        old = prev["warehouses"].get(wid)
        if dt <= 0 or old is None or "put_bytes" not in w or "put_bytes" not in old:
            continue
        if w["put_bytes"] < old["put_bytes"] or w["get_bytes"] < old["get_bytes"]:
            continue  # the warehouse restarted: its counters began again
        w["in_per_s"] = (w["put_bytes"] - old["put_bytes"]) / dt
        w["out_per_s"] = (w["get_bytes"] - old["get_bytes"]) / dt
    return cur


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _rate(w: dict, key: str) -> str:
    return human_bytes(w[key]) if key in w else "-"


def slowest(consumers: dict[str, dict]) -> str | None:
    """The consumer furthest behind (fewest taken), if there are at least two."""
    if len(consumers) < 2:
        return None
    return min(consumers, key=lambda c: (consumers[c]["taken"], c))


class _Fitted:
    """A table drawn at the console's width without cutting what it exists to show: columns of
    `optional` (least important first) are left out until the rest fits, and the columns `build`
    marks to keep (an address, a state, a consumer's name) are never narrower than their longest
    cell; only one wider than the console by itself folds onto a second line."""

    def __init__(self, build: Callable[[frozenset[str]], Table], optional: Sequence[str]) -> None:
        self.build, self.optional = build, optional

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update(width=1 << 16)  # (a measurement is clamped to the width it is given)
        left_out: frozenset[str] = frozenset()
        table = self.build(left_out)
        for col in self.optional:
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                break
            left_out |= {col}
            table = self.build(left_out)
        kept = [c for c in table.columns if c.overflow == "fold"]
        for column in kept:
            column.min_width = max((cell_len(str(c)) for c in column.cells), default=0)
        if Measurement.get(console, unbounded, table).maximum > options.max_width:
            for column in kept:  # (a console too narrow for them even alone: they fold, whole, onto more lines)
                column.min_width = None
        yield table


def _columns(table: Table, names: Sequence[str], left_out: frozenset[str], *, keep: Sequence[str],
             right: Sequence[str]) -> list[str]:
    """Add the columns of `names` not left out (`keep`: never cut); returns those added."""
    shown = [c for c in names if c not in left_out]
    for col in shown:
        kept = col in keep
        table.add_column(col, justify="right" if col in right else "left", no_wrap=not kept,
                         overflow="fold" if kept else "ellipsis")
    return shown


def _row(table: Table, shown: Sequence[str], cells: dict[str, Any]) -> None:
    table.add_row(*(cells[c] for c in shown))


def _warehouses(whs: dict) -> _Fitted:
    names = ("id", "address", "state", "used", "", "in/s", "out/s", "serves", "version")

    def build(left_out: frozenset[str]) -> Table:
        wt = Table(title="warehouses", title_justify="left", expand=False)
        shown = _columns(wt, names, left_out, keep=("address", "state"), right=("id", "in/s", "out/s"))
        for wid, w in sorted(whs.items()):
            cap = w["capacity"] or 1
            state = w["state"] if w["alive"] or w["state"] != "joined" else "down"
            style = "green" if state == "joined" else ("yellow" if state == "rejoining" else "red")
            _row(wt, shown, {
                "id": str(wid), "address": w["address"],
                "state": Text(state if "error" not in w else "unreachable", style=style),
                "used": f"{human_bytes(w['bytes'])} / {human_bytes(w['capacity'])}",
                "": ProgressBar(total=cap, completed=min(w["bytes"], cap), width=10),
                "in/s": _rate(w, "in_per_s"), "out/s": _rate(w, "out_per_s"), "serves": w.get("serves", "-"),
                "version": w.get("version", "-"),
            })
        return wt

    return _Fitted(build, ("", "version", "serves", "out/s", "in/s", "used", "id"))


def holding_back(p: dict) -> str | None:
    """With max_pending: the consumer puts wait for most (the most samples not yet handed to it)."""
    by = p.get("pending_by") or {}
    top = max(by, key=lambda c: (by[c], c), default=None)
    return top if top is not None and by[top] else None


def _partition(name: str, p: dict, *, controller: str) -> _Fitted:
    paced = p.get("max_pending")
    by = p.get("pending_by") or {}
    title = (f"partition {name}: {p['samples']:,} samples"
             + (f", groups of {p['group_size']}" if p["group_size"] > 1 else "")
             + (f", {p['deleted']:,} deleted" if p.get("deleted") else "")
             + (" (sealed)" if p.get("sealed") else "")
             + (f", {p['under_replicated']:,} values on one warehouse" if p.get("under_replicated") else "")
             + (" (recovered)" if p["recovered"] else "")
             + (f", {p.get('pending', 0):,} pending of max_pending {paced:,}" if paced else "")
             + (f", {p['paced_puts']} puts waiting" if paced and p.get("paced_puts") else "")
             + (f"  [controller {controller}]" if controller else ""))
    consumers = dict(p["consumers"])
    for c in by:  # (a consumer retire_when_consumed_by names that never asked: puts wait for it all the same)
        consumers.setdefault(c, {"taken": 0, "leased": 0, "ready": 0, "waiting": 0, "never_asked": True})
    late = slowest(p["consumers"])
    full = paced and (p.get("pending", 0) >= paced or p.get("paced_puts"))
    top = holding_back(p)
    names = ("consumer", "taken", "", *(("pending",) if paced else ()), "ready", "leased", "waiting")

    def build(left_out: frozenset[str]) -> Table:
        pt = Table(title=Text(title), title_justify="left")  # (Text: a name or "[controller ...]" is no markup)
        shown = _columns(pt, names, left_out, keep=("consumer",), right=("taken", "pending", "ready", "leased",
                                                                         "waiting"))
        total = max(p["samples"], 1)
        for cname, c in sorted(consumers.items()):
            marks = [m for m, on in (("never asked", c.get("never_asked")), ("slowest", cname == late),
                                     ("holds puts back" if full else "most pending", cname == top)) if on]
            _row(pt, shown, {
                "consumer": Text(cname + "".join(f"  ({m})" for m in marks),
                                 style="bold yellow" if cname in (late, top) else ""),
                "taken": f"{c['taken']:,}", "": ProgressBar(total=total, completed=min(c["taken"], total), width=16),
                "pending": f"{by[cname]:,}" if cname in by else "-",
                "ready": f"{c['ready']:,}", "leased": f"{c['leased']:,}", "waiting": str(c["waiting"]),
            })
        if not consumers:
            _row(pt, shown, {c: "(no consumer yet)" if c == "consumer" else "" for c in shown})
        return pt

    return _Fitted(build, ("", "leased", "waiting", "ready", "taken"))


def render(snap: dict[str, Any], *, address: str, error: str = "") -> Group:
    """The status view; drawn at any width, it leaves columns out rather than cut an address, a state
    or a consumer's name."""
    parts: list = []
    whs = snap["warehouses"]
    alive = sum(w["alive"] for w in whs.values())
    several = len(snap.get("controllers", ())) > 1
    where = f"controllers {', '.join(snap['controllers'])}" if several else f"controller {address}"
    head = Text.assemble(
        ("dockd ", "bold"), (snap.get("version") or "?", "bold cyan"), f"  {where}  ",
        f"warehouses {alive}/{len(whs)} alive  samples {snap['samples']:,}  stored {human_bytes(snap['bytes'])}  "
        f"gets waiting {snap['waiting']}",
    )
    parts.append(head)
    if error:
        parts.append(Text(f"unreachable: {error}", style="bold red"))
    parts.append(_warehouses(whs))

    shards = {shard for p in snap["partitions"].values() for shard in p.get("shards", ())}
    names = [name for name in snap["partitions"] if name not in shards]  # (a spread partition: its sum, once)
    shown = names[-MAX_PARTITIONS:]
    for name in shown:
        p = snap["partitions"][name]
        where = p.get("controller", "")
        where = ", ".join(where) if isinstance(where, list) else where
        parts.append(_partition(name, p, controller=where if several else ""))
    if len(names) > len(shown):
        parts.append(Text(f"... and {len(names) - len(shown)} older partitions (dockd status --json lists all)",
                          style="dim"))
    return Group(*parts)


def run(dock, *, address: str, watch: bool, interval: float, as_json: bool, console=None) -> int:
    """Print the status once (rates measured over `interval` seconds; 0: none), or refresh it
    every `interval` seconds until interrupted (`watch`). JSON: one object per snapshot."""
    from rich.live import Live

    console = console or Console()
    snap: dict[str, Any] | None
    if not watch:
        prev = snapshot(dock) if interval > 0 else None
        if prev is not None:
            time.sleep(interval)
        snap = with_rates(snapshot(dock), prev)
        if as_json:
            print(json.dumps(snap, default=str))
        else:
            console.print(render(snap, address=address))
        return 0
    prev = None
    last: dict[str, Any] | None = None
    live = None if as_json else Live(console=console, auto_refresh=False)
    stop = threading.Event()
    # Ctrl-C ends the loop between snapshots: a KeyboardInterrupt raised wherever the client happens
    # to be (a finalizer, a cleanup) could be swallowed there and leave the watch running.
    previous = _on_interrupt(stop.set)
    try:
        if live is not None:
            live.start()
        while not stop.is_set():
            error = ""
            try:
                snap = with_rates(snapshot(dock), prev)
                prev = last = snap
            except DockError as e:  # a dock that is away is shown, and retried
                error, snap = str(e), last
            if live is None:  # (as_json)
                print(json.dumps(snap if not error else {"time": time.time(), "error": error}, default=str), flush=True)
            elif snap is not None:
                live.update(render(snap, address=address, error=error), refresh=True)
            else:
                live.update(Text(f"unreachable: {error}", style="bold red"), refresh=True)
            stop.wait(interval)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if live is not None:
            live.stop()


def _on_interrupt(handler) -> Any:
    """Call `handler` on SIGINT instead of raising KeyboardInterrupt; returns the handler it replaced
    (None off the main thread, where signals cannot be set: Ctrl-C then raises as usual)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, lambda signum, frame: handler())
