"""choose_home: which warehouse a client's puts go to, from the dock's warehouse table."""

from __future__ import annotations

import os

import pytest

from dockd._proto import dockd_pb2 as pb
from dockd.client.home import choose_home
from dockd.errors import DockConnectionError, DockValueError


def table(*rows) -> dict[int, pb.WarehouseInfo]:
    return {wid: pb.WarehouseInfo(id=wid, host=host, port=port, alive=alive, state=state)
            for wid, host, port, alive, state in rows}


def home(warehouses, pinned=None, prefer=None, exclude=None, retrying=False) -> int:
    return choose_home(warehouses, pinned=pinned, prefer=prefer, exclude=exclude, retrying=retrying,
                       address="10.0.0.1:7450")


def test_a_warehouse_on_this_host_spread_by_process_id_else_any_live_one():
    here = table((0, "192.0.2.1", 1, True, ""), (1, "127.0.0.1", 2, True, ""), (2, "127.0.0.1", 3, True, ""))
    assert home(here) == [1, 2][os.getpid() % 2]
    elsewhere = table((0, "192.0.2.1", 1, False, "lost"), (5, "192.0.2.2", 1, True, ""))
    assert home(elsewhere) == 5  # (the dead one is never chosen)


def test_the_preferred_address_wins_while_it_is_live():
    ws = table((0, "127.0.0.1", 1, True, ""), (1, "192.0.2.1", 2, True, ""))
    assert home(ws, prefer="192.0.2.1:2") == 1
    ws[1].alive = False
    assert home(ws, prefer="192.0.2.1:2") == 0


def test_exclude_leaves_out_the_warehouse_that_failed():
    ws = table((0, "127.0.0.1", 1, True, ""), (1, "127.0.0.1", 2, True, ""))
    assert home(ws, exclude=0) == 1
    with pytest.raises(DockConnectionError, match="has no live warehouse"):
        home(table((0, "127.0.0.1", 1, True, "")), exclude=0)
    with pytest.raises(DockConnectionError, match="the dock at 10.0.0.1:7450 has no live warehouse"):
        home({})


def test_a_pinned_warehouse_by_id_or_address_also_while_unresponsive():
    ws = table((0, "127.0.0.1", 1, True, ""), (3, "192.0.2.1", 7, False, "unresponsive"))
    assert home(ws, pinned=3) == home(ws, pinned="3") == home(ws, pinned="192.0.2.1:7") == 3
    assert home(ws, pinned=3, exclude=3) == 3  # (a pinned client is never moved)


def test_a_pinned_warehouse_that_is_away_is_waited_for_only_when_retrying():
    ws = table((0, "127.0.0.1", 1, True, ""), (3, "192.0.2.1", 7, False, "lost"))
    with pytest.raises(DockConnectionError, match="which this client is pinned to, is not live"):
        home(ws, pinned=3, retrying=True)
    with pytest.raises(DockValueError, match=r"warehouse 3 is not a live member .* members: \['0=127.0.0.1:1'\]"):
        home(ws, pinned=3)
