"""The multinode benchmark's per-iteration instruments: where reads go, what a put waits, what the links
lose (tbf drops, TCP retransmissions and timeouts), and the report table made of them. No root."""

from __future__ import annotations

from benchmarks.multinode import agent as mn_agent
from benchmarks.multinode import report
from benchmarks.multinode.netns import tcp_counters

SNMP = """Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm ActiveOpens RetransSegs OutRsts
Tcp: 1 10 42 0
TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes
TcpExt: 0 3 7
"""


def test_tcp_counters_pick_retransmissions_timeouts_and_probes():
    assert tcp_counters(SNMP) == {"retrans_segs": 42, "rto_timeouts": 3, "loss_probes": 7}
    assert tcp_counters("") == {"retrans_segs": 0, "rto_timeouts": 0, "loss_probes": 0}


def test_worker_reports_merge_per_call_origins():
    merged = mn_agent.merge_workers({
        "reward": {"start": 0.0, "end": 1.0, "bytes": 1, "calls": 1, "keys": [1], "call_s": [0.5],
                   "call_at": [0.0], "call_local": [8]},
        "reward#1": {"start": 0.0, "end": 1.0, "bytes": 1, "calls": 1, "keys": [2], "call_s": [0.4],
                     "call_at": [0.1], "call_local": [0]},
    })
    assert merged["reward"]["call_at"] == [0.0, 0.1] and merged["reward"]["call_local"] == [8, 0]


def _iteration(remote: int, drops: int, resent: int, rto: int, warmup: bool = False) -> dict:
    return {"warmup": warmup, "remote_read_bytes": {"0": remote, "1": 0}, "warehouse_served": {"0": 50, "1": 50},
            "stages": {"0": {"rollout": {"in_calls_s": 0.08, "calls": 4}},
                       "1": {"rollout": {"in_calls_s": 0.12, "calls": 4}}},
            "link_drops": {"0": {"tx_drops": drops, "rx_drops": 0}, "1": {"tx_drops": 0, "rx_drops": 1}},
            "tcp": {"0": {"retrans_segs": resent, "rto_timeouts": rto, "loss_probes": 0},
                    "1": {"retrans_segs": 0, "rto_timeouts": 0, "loss_probes": 0}}}


def test_reads_table_takes_medians_of_the_measured_iterations():
    run = {"layout": "distributed", "nodes": 2, "status": "ok", "check": None,
           "iterations": [_iteration(100, 900, 900, 9, warmup=True), _iteration(40, 10, 20, 1),
                          _iteration(60, 30, 40, 0), _iteration(50, 20, 30, 2)]}
    table = report.reads_table({"runs": [run]})
    # reads local: 1 - 50/100 (median); put 25 ms (median of 20 and 30); drops 21; resent 30; timeouts 1.0 (mean)
    assert "| 2 | dockd distributed | 50% | 25 | 21 | 30 | 1.0 |" in table, table
    old = dict(run, iterations=[{k: v for k, v in i.items() if k not in ("link_drops", "tcp")}
                                for i in run["iterations"]])
    assert report.reads_table({"runs": [old]}) == ""  # a run recorded before these instruments: no table
