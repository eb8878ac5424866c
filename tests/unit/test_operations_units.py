"""Pure parts of operations: the JSON log formatter, the request histogram, the status view's arithmetic."""

from __future__ import annotations

import io
import json
import logging

from rich.console import Console

from dockd.cli import JsonFormatter
from dockd.node.metrics import BUCKETS, Histogram
from dockd.status import render, slowest, with_rates


def _log(fmt: logging.Formatter, msg: str, *args, exc: bool = False) -> dict:
    logger = logging.getLogger("dockd.test")
    record = logger.makeRecord("dockd.test", logging.WARNING, __file__, 1, msg, args,
                               None if not exc else (ValueError, ValueError("boom"), None))
    return json.loads(fmt.format(record))


def test_json_logs_split_component_event_and_fields():
    out = _log(JsonFormatter(), "[controller] warehouse away id=%d address=%s reason=%r; waiting up to %gs",
               3, "10.0.0.2:7450", "connection lost", 15.0)
    assert out["component"] == "controller" and out["event"] == "warehouse away"
    assert out["id"] == 3 and out["address"] == "10.0.0.2:7450" and out["reason"] == "connection lost"
    assert out["level"] == "warning" and out["msg"].startswith("[controller] warehouse away id=3")
    plain = _log(JsonFormatter(), "no fields here", exc=True)
    assert plain["event"] == "no fields here" and "component" not in plain and "ValueError: boom" in plain["exc"]
    clash = _log(JsonFormatter(), "[node] x level=debug pid=1 count=2")
    assert clash["level"] == "warning" and clash["count"] == 2  # fields never overwrite the record's own keys


def test_histogram_buckets_are_cumulative():
    h = Histogram()
    for s in (0.00005, 0.0003, 0.0003, 7.0, 1e6):
        h.observe(s)
    cum = dict(h.cumulative())
    assert cum[repr(BUCKETS[0])] == 1 and cum["0.0005"] == 3 and cum["10.0"] == 4 and cum["+Inf"] == 5
    assert abs(h.total - (0.00065 + 7.0 + 1e6)) < 1e-6


def _snap(t: float, put: int, get: int, *, error: bool = False) -> dict:
    w = {"address": "127.0.0.1:1", "alive": True, "state": "joined", "capacity": 100, "bytes": 40}
    w.update({"error": "refused"} if error else {"put_bytes": put, "get_bytes": get, "version": "0.2.0"})
    return {"time": t, "version": "0.2.0", "samples": 10, "bytes": 40, "waiting": 1, "warehouses": {0: w},
            "partitions": {"step-1": {"samples": 10, "group_size": 2, "recovered": False, "columns": {},
                                      "consumers": {"a": {"taken": 8, "leased": 0, "ready": 2, "waiting": 0},
                                                    "b": {"taken": 2, "leased": 4, "ready": 4, "waiting": 1}}}}}


def test_rates_come_from_two_snapshots_and_skip_restarts():
    cur = with_rates(_snap(12.0, 3000, 500), _snap(10.0, 1000, 100))
    assert cur["warehouses"][0]["in_per_s"] == 1000 and cur["warehouses"][0]["out_per_s"] == 200
    restarted = with_rates(_snap(12.0, 10, 10), _snap(10.0, 1000, 100))
    assert "in_per_s" not in restarted["warehouses"][0]
    gone = with_rates(_snap(12.0, 0, 0, error=True), _snap(10.0, 1000, 100))
    assert "in_per_s" not in gone["warehouses"][0]


def test_the_view_marks_the_slowest_consumer_and_unreachable_warehouses():
    assert slowest({"a": {"taken": 3}}) is None
    snap = with_rates(_snap(12.0, 0, 0, error=True), None)
    console = Console(file=io.StringIO(), width=100)
    console.print(render(snap, address="h:1", error="controller away"))
    text = console.file.getvalue()
    assert "unreachable" in text and "controller away" in text
    assert "partition step-1: 10 samples, groups of 2" in text
    assert "b  (slowest)" in text and "a  (slowest)" not in text
    snap["partitions"]["step-1"].update(deleted=4, sealed=True)
    console = Console(file=io.StringIO(), width=100)
    console.print(render(snap, address="h:1"))
    assert "partition step-1: 10 samples, groups of 2, 4 deleted (sealed)" in console.file.getvalue()
    snap["partitions"]["step-1"].update(under_replicated=6)
    console = Console(file=io.StringIO(), width=120)
    console.print(render(snap, address="h:1"))
    assert "(sealed), 6 values on one warehouse" in " ".join(console.file.getvalue().split())
