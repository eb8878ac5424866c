"""`dockd status` at the width of an ordinary terminal: it leaves columns out rather than cut the
addresses, states and consumer names it exists to show, and marks the consumer puts wait for."""

from __future__ import annotations

import io

from rich.console import Console

from dockd import status

ADDRESSES = ["127.0.0.1:45001", "127.0.0.1:45002", "[2001:db8::1234]:7450", "10.200.100.17:7450"]
STATES = ["joined", "rejoining", "joined", "lost"]


def _warehouse(address: str, state: str) -> dict:
    return {"address": address, "alive": state != "lost", "state": state, "capacity": 64 << 30,
            "bytes": 12_345_678_901, "put_bytes": 1, "get_bytes": 2, "in_per_s": 1.5e9, "out_per_s": 9.8e8,
            "serves": "mooncake", "version": "0.12.0rc1"}


def _snap() -> dict:
    consumers = {"actor_train": {"taken": 992, "leased": 8, "ready": 0, "waiting": 2},
                 "reference_typo": {"taken": 0, "leased": 0, "ready": 1000, "waiting": 0}}
    return {"time": 1.0, "version": "0.12.0rc1", "samples": 1000, "bytes": 40, "waiting": 2,
            "controllers": [ADDRESSES[0]],
            "warehouses": {i: _warehouse(a, s) for i, (a, s) in enumerate(zip(ADDRESSES, STATES))},
            "partitions": {"rollouts": {"samples": 1000, "group_size": 8, "recovered": False, "columns": {},
                                        "max_pending": 8, "pending": 8, "paced_puts": 3, "consumers": consumers,
                                        "pending_by": {"reference_typo": 8, "actor_train": 0}}}}


def _draw(snap: dict, width: int) -> str:
    console = Console(file=io.StringIO(), width=width)
    console.print(status.render(snap, address=ADDRESSES[0]))
    return console.file.getvalue()


def test_at_80_columns_no_address_or_state_is_cut():
    for width in (80, 100, 60):
        text = _draw(_snap(), width)
        assert all(len(line) <= width for line in text.splitlines())
        rows = [line for line in text.splitlines() if line.startswith("│")]  # (the tables' rows)
        for address, state in zip(ADDRESSES, STATES):
            row = next((r for r in rows if address in r), None)
            assert row is not None, f"address {address} cut at {width} columns:\n{text}"
            shown = "down" if state == "lost" else state  # (a lost member that is not alive shows its state)
            assert f" {shown} " in row or f" {state} " in row, f"state of {address} cut at {width} columns:\n{text}"
        assert "…" not in "".join(rows)
        assert "reference_typo" in text and "actor_train" in text
    assert "mooncake" in _draw(_snap(), 160)  # (a wide console still shows every column)


def test_the_consumer_puts_wait_for_is_marked():
    snap = _snap()
    assert status.holding_back(snap["partitions"]["rollouts"]) == "reference_typo"
    text = _draw(snap, 80)
    line = next(line for line in text.splitlines() if "reference_typo" in line)
    assert "holds puts back" in line
    assert "8 pending of max_pending 8" in " ".join(text.split())
    snap["partitions"]["rollouts"].update(pending=2, paced_puts=0, pending_by={"reference_typo": 2, "actor_train": 0})
    line = next(line for line in _draw(snap, 80).splitlines() if "reference_typo" in line)
    assert "most pending" in line and "holds puts back" not in line
    snap["partitions"]["rollouts"].update(max_pending=None, pending_by={})
    assert "pending" not in _draw(snap, 80)


def test_a_spread_partition_is_shown_once_with_its_controllers():
    snap = _snap()
    snap["controllers"] = ADDRESSES[:2]
    shard = dict(snap["partitions"]["rollouts"], controller=ADDRESSES[0], max_pending=None, pending_by={})
    names = ["rollouts~shard-0-of-2", "rollouts~shard-1-of-2"]
    snap["partitions"] = {names[0]: shard, names[1]: dict(shard, controller=ADDRESSES[1]),
                          "rollouts": dict(shard, shards=names, controller=ADDRESSES[:2])}
    text = " ".join(_draw(snap, 160).split())
    assert "shard-" not in text and text.count("partition rollouts:") == 1
    assert f"[controller {ADDRESSES[0]}, {ADDRESSES[1]}]" in text
