"""`dockd serve` settings that cannot work are refused when the configuration is built, naming the
fix: timeouts that are not a number, sizes past 64 bits, a dock that takes no sample, a warehouse that
joins itself, a controller list that names this controller twice, a state dir kept under another
controller list, client environment amounts that are negative or not a number."""

from __future__ import annotations

import json

import pytest

from dockd import owners
from dockd.config import ClientConfig, NodeConfig
from dockd.errors import DockConfigError, DockValueError


@pytest.mark.parametrize("name", ["lease_timeout", "controller_grace", "warehouse_grace", "handshake_timeout",
                                  "stall_timeout", "idle_timeout", "daemon_timeout", "heartbeat_interval",
                                  "heartbeat_timeout", "join_timeout"])
def test_a_timeout_that_is_not_a_number_is_refused(name):
    """NaN passed `<= 0`: --handshake-timeout nan started, then every connection's handshake raised."""
    with pytest.raises(DockValueError, match=r"must be > 0 seconds, got nan"):
        NodeConfig(controller=True, **{name: float("nan")})
    NodeConfig(controller=True, **{name: float("inf")})  # (no limit: works)


def test_a_dock_that_takes_no_sample_is_refused():
    for n in (0, -5):
        with pytest.raises(DockValueError, match=f"--max-samples must be 1 or more .*DockFull.*got {n}"):
            NodeConfig(controller=True, max_samples=n)


@pytest.mark.parametrize("name, flag", [("capacity", "--capacity"), ("device_capacity", "--device-capacity"),
                                        ("min_rate", "--min-rate")])
def test_a_size_past_64_bits_is_refused(name, flag):
    """--capacity 1e30 ended in a traceback (a protobuf field out of range) after the node was built."""
    with pytest.raises(DockValueError, match=f"{flag} {10**30} is past the {(1 << 63) - 1} bytes"):
        NodeConfig(controller=True, **{name: 10**30})


@pytest.mark.parametrize("join", ["127.0.0.1:7460", "localhost:7460", "h1:7460", "127.0.0.1:1,127.0.0.1:7460"])
def test_a_warehouse_that_joins_its_own_address_is_refused(join):
    """It waited for ever, logging that it is a warehouse without the controller every second."""
    with pytest.raises(DockValueError, match=r"--join \S+:7460 is this warehouse's own address \(--port 7460\)"):
        NodeConfig(join=join, port=7460, advertise="h1")
    NodeConfig(join="127.0.0.1:7461", port=7460)
    NodeConfig(join="127.0.0.1:7460", port=0)  # (port 0: a free one, never the controller's)


@pytest.mark.parametrize("listed", [["127.0.0.1:7460", "localhost:7460"], ["h1:7460", "10.0.0.1:7460"],
                                    ["[::1]:7460", "127.0.0.1:7460"]])
def test_a_controller_list_that_names_this_controller_twice_is_refused(listed):
    """Both entries owned partitions: those of the second went to this controller under another name,
    and the warehouse it hosts was refused by itself for them."""
    host = "10.0.0.1" if "h1:7460" in listed else "127.0.0.1"
    with pytest.raises(DockValueError, match="names this controller twice"):
        NodeConfig(controller=True, host=host, advertise="h1" if host != "127.0.0.1" else "", port=7460,
                   controllers=tuple(listed), insecure=host != "127.0.0.1")
    assert owners.own_index(("127.0.0.1:7460", "127.0.0.1:7461", "localhost:7462"), "127.0.0.1", 7460) == 0


def test_names_this_node():
    assert owners.names_this_node("localhost:5", "127.0.0.1", 5)
    assert owners.names_this_node("127.0.0.2:5", "0.0.0.0", 5)
    assert owners.names_this_node("node1:5", "10.0.0.1", 5, "node1")
    assert not owners.names_this_node("10.0.0.2:5", "10.0.0.1", 5)
    assert not owners.names_this_node("localhost:6", "127.0.0.1", 5)
    assert not owners.names_this_node("localhost:5", "10.0.0.1", 5)


def test_a_state_dir_kept_under_another_controller_list_is_refused(tmp_path):
    """Restarted with the list reordered (or grown, or at another place in it), a controller served the
    partitions of its new share, which its journal knew nothing of, and left those it had kept."""
    state = str(tmp_path / "state")
    owners.check_recorded(state, ("a:1", "b:1"), "a:1")  # nothing recorded: anything goes
    owners.record_list(state, ("a:1", "b:1"), "a:1")
    assert json.loads((tmp_path / "state" / owners.LIST_FILE).read_text()) == {"controllers": ["a:1", "b:1"],
                                                                                "own": "a:1"}
    owners.check_recorded(state, ("a:1", "b:1"), "a:1")
    for listed, own in ((("b:1", "a:1"), "a:1"), (("a:1", "b:1", "c:1"), "a:1"), (("a:1", "b:1"), "b:1"), ((), "")):
        with pytest.raises(DockConfigError, match=r"was kept by a controller started with --controllers a:1,b:1 "
                                                  r"\(as a:1\).*Start it with the list it had.*new --state-dir"):
            owners.check_recorded(state, listed, own)
    owners.record_list(state, (), "")
    with pytest.raises(DockConfigError, match=r"started with one controller \(no --controllers\); this one has "
                                              r"--controllers a:1,b:1 \(as a:1\)"):
        owners.check_recorded(state, ("a:1", "b:1"), "a:1")
    (tmp_path / "state" / owners.LIST_FILE).write_text("{")
    with pytest.raises(DockValueError, match="cannot read .*controllers.json"):
        owners.check_recorded(state, (), "")


@pytest.mark.parametrize("name, value", [("DOCKD_SPIN_US", "-5"), ("DOCKD_SPIN_US", "nan"),
                                         ("DOCKD_RECV_POOL_BYTES", "nan"), ("DOCKD_RECV_POOL_BYTES", "-1"),
                                         ("DOCKD_RECV_POOL_BYTES", "inf")])
def test_a_client_amount_that_is_negative_or_not_finite_names_its_variable(monkeypatch, name, value):
    """DOCKD_RECV_POOL_BYTES=nan raised a bare ValueError; negative values and NaN spins were taken."""
    monkeypatch.setenv(name, value)
    with pytest.raises(DockValueError, match=f"{name}='{value}': give a finite number of"):
        ClientConfig.from_env()
    monkeypatch.setenv(name, "0")
    ClientConfig.from_env()


def test_an_advertised_address_with_a_port_is_refused():
    """--advertise 127.0.0.1:9999 served under 127.0.0.1:9999:PORT, which nobody could reach."""
    with pytest.raises(DockValueError, match="--advertise '127.0.0.1:9999': give the host name or address"):
        NodeConfig(controller=True, advertise="127.0.0.1:9999")
    for host in ("::1", "[::1]", "node-1", "10.0.0.1"):
        NodeConfig(controller=True, advertise=host)
