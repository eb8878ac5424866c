"""`dockd status ADDRESS`: what a dock holds and how its consumers keep up.

One snapshot is `Dock.stats(traffic=True)` with the time it was taken; two
snapshots give each warehouse's bytes in and out per second. The view is drawn
with rich: warehouses (address, state, used of capacity, traffic, how each serves remote
readers: "socket" or "mooncake"), then per
partition each consumer's progress (taken of the partition's samples, with
what it could take now, holds under lease and waits for), the slowest
consumer marked.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

from rich.console import Group
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


def render(snap: dict[str, Any], *, address: str, error: str = "") -> Group:
    parts: list = []
    whs = snap["warehouses"]
    alive = sum(w["alive"] for w in whs.values())
    several = len(snap.get("controllers", ())) > 1
    where = f"controllers {','.join(snap['controllers'])}" if several else f"controller {address}"
    head = Text.assemble(
        ("dockd ", "bold"), (snap.get("version") or "?", "bold cyan"), f"  {where}  ",
        f"warehouses {alive}/{len(whs)} alive  samples {snap['samples']:,}  stored {human_bytes(snap['bytes'])}  "
        f"gets waiting {snap['waiting']}",
    )
    parts.append(head)
    if error:
        parts.append(Text(f"unreachable: {error}", style="bold red"))

    wt = Table(title="warehouses", title_justify="left", expand=False)
    for col in ("id", "address", "state", "used", "", "in/s", "out/s", "serves", "version"):
        wt.add_column(col, justify="right" if col in ("id", "in/s", "out/s") else "left", no_wrap=True)
    for wid, w in sorted(whs.items()):
        cap = w["capacity"] or 1
        state = w["state"] if w["alive"] or w["state"] != "joined" else "down"
        style = "green" if state == "joined" else ("yellow" if state == "rejoining" else "red")
        wt.add_row(
            str(wid), w["address"], Text(state if "error" not in w else "unreachable", style=style),
            f"{human_bytes(w['bytes'])} / {human_bytes(w['capacity'])}",
            ProgressBar(total=cap, completed=min(w["bytes"], cap), width=10),
            _rate(w, "in_per_s"), _rate(w, "out_per_s"), w.get("serves", "-"), w.get("version", "-"),
        )
    parts.append(wt)

    names = list(snap["partitions"])
    shown = names[-MAX_PARTITIONS:]
    for name in shown:
        p = snap["partitions"][name]
        pt = Table(title=f"partition {name}: {p['samples']:,} samples"
                   + (f", groups of {p['group_size']}" if p["group_size"] > 1 else "")
                   + (f", {p['deleted']:,} deleted" if p.get("deleted") else "")
                   + (" (sealed)" if p.get("sealed") else "")
                   + (f", {p['under_replicated']:,} values on one warehouse" if p.get("under_replicated") else "")
                   + (" (recovered)" if p["recovered"] else "")
                   + (f"  [controller {p['controller']}]" if several and p.get("controller") else ""),
                   title_justify="left")
        for col in ("consumer", "taken", "", "ready", "leased", "waiting"):
            pt.add_column(col, justify="left" if col in ("consumer", "") else "right", no_wrap=True)
        late = slowest(p["consumers"])
        total = max(p["samples"], 1)
        for cname, c in sorted(p["consumers"].items()):
            pt.add_row(
                Text(cname + ("  (slowest)" if cname == late else ""), style="bold yellow" if cname == late else ""),
                f"{c['taken']:,}", ProgressBar(total=total, completed=min(c["taken"], total), width=16),
                f"{c['ready']:,}", f"{c['leased']:,}", str(c["waiting"]),
            )
        if not p["consumers"]:
            pt.add_row("(no consumer yet)", "", "", "", "", "")
        parts.append(pt)
    if len(names) > len(shown):
        parts.append(Text(f"... and {len(names) - len(shown)} older partitions (dockd status --json lists all)",
                          style="dim"))
    return Group(*parts)


def run(dock, *, address: str, watch: bool, interval: float, as_json: bool, console=None) -> int:
    """Print the status once (rates measured over `interval` seconds; 0: none), or refresh it
    every `interval` seconds until interrupted (`watch`). JSON: one object per snapshot."""
    from rich.console import Console
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
