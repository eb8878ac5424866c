"""A simulated cluster: N network namespaces on one Linux bridge, every link rate-capped both ways.

Layout (nothing is created in the root namespace)::

    <tag>-sw   the switch: bridge ``br0`` and one port ``p<i>`` per node
    <tag>-n<i> node i: ``lo`` and ``eth0`` = 10.88.0.<i+1>/24, the other end of ``p<i>``

Each link is capped in both directions with a token bucket (``tc ... tbf``):
on the node's ``eth0`` (egress: what the node sends) and on the switch port
``p<i>`` (egress toward the node: what it receives). Byte counters are read
from the switch ports (``ip -s -j link``): a port's ``tx`` is what its node
received, its ``rx`` what the node sent.

The run tag is ``<prefix><4 hex>p<pid>``: unique per run, and it names the
process that owns the namespaces, so :func:`cleanup_leftovers` can remove
what a killed run left behind without touching a live run's namespaces.
:meth:`Topology.destroy` kills every process still inside the namespaces,
then deletes them (the veth pairs and the bridge go with them); it is
idempotent and runs from ``finally`` blocks, so also after Ctrl-C, SIGTERM or SIGHUP
(the entry point turns those into an exception).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "dkmn"
DEFAULT_SUBNET = "10.88.0"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class NetnsError(RuntimeError):
    """A command that builds or inspects the simulated cluster failed."""


def missing_privileges(prefix: str = DEFAULT_PREFIX) -> str | None:
    """``None`` when namespaces, veth pairs, bridges and tbf can be built here, else a one-line reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridge and tc); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2), which is not installed"
    probe = f"{check_prefix(prefix)}probe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe], timeout=10)
        try:
            _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], timeout=10)
            _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], timeout=10)
            _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit",
                  "burst", "64kb", "latency", "100ms"], timeout=10)
        finally:
            _run(["ip", "netns", "del", probe], check=False, timeout=10)
    except NetnsError as e:
        return f"cannot build namespaces, veth pairs, bridges or tbf here: {e}"
    return None


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must be 1-8 lowercase letters/digits starting with a letter, got {prefix!r}")
    return prefix


def new_tag(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{check_prefix(prefix)}{secrets.token_hex(2)}p{os.getpid()}"


def _run(args: list[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(args)}` did not finish within {timeout:g}s") from e
    if check and out.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def root_links(prefix: str) -> list[str]:
    """Interfaces in the root namespace whose name starts with ``prefix`` (this module makes none)."""
    out = _run(["ip", "-o", "link", "show"], check=False)
    names = [line.split(":", 2)[1].strip().split("@")[0] for line in out.stdout.splitlines() if ":" in line]
    return [n for n in names if n.startswith(prefix)]


def kill_processes(namespaces: list[str], grace: float = 5.0) -> int:
    """SIGTERM every process inside these namespaces, wait up to ``grace``, SIGKILL the rest.

    Only what runs inside the run's own namespaces is touched, never a process found by name."""
    pids = [p for ns in namespaces for p in namespace_pids(ns)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for ns in namespaces:
        for pid in namespace_pids(ns):
            if alive(pid):
                logger.info("[netns] pid %d (%s) in %s ignored SIGTERM for %.0fs; killing it",
                            pid, _comm(pid), ns, grace)
                _signal(pid, signal.SIGKILL)
    return len(pids)


def remove_namespaces(namespaces: list[str], grace: float = 5.0) -> list[str]:
    """Kill every process inside, then delete the namespaces. Returns what could not be deleted."""
    kill_processes(namespaces, grace)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for ns in namespaces for p in namespace_pids(ns)):
        time.sleep(0.1)
    failed = []
    for ns in namespaces:
        out = _run(["ip", "netns", "del", ns], check=False)
        if out.returncode != 0 and ns in list_namespaces():
            failed.append(f"{ns}: {out.stderr.strip()}")
    return failed


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cleanup_leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove namespaces of earlier runs with this prefix whose owning process is gone."""
    pat = re.compile(rf"^{re.escape(check_prefix(prefix))}[0-9a-f]{{4}}p(\d+)-(sw|n\d+)$")
    stale = []
    for ns in list_namespaces():
        m = pat.match(ns)
        if m and not alive(int(m.group(1))):
            stale.append(ns)
    if stale:
        logger.warning("[netns] removing %d namespaces left behind by earlier runs: %s", len(stale), ", ".join(stale))
        remove_namespaces(stale)
    return stale


@dataclasses.dataclass(slots=True)
class SimNode:
    index: int
    ns: str
    ip: str
    port: str
    """The switch port (in the switch namespace) that leads to this node."""

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


class Topology:
    """N nodes on a bridge, links capped at ``rate_mbit`` in both directions. A context manager."""

    def __init__(self, n_nodes: int, rate_mbit: float, *, tag: str, subnet: str = DEFAULT_SUBNET,
                 burst_bytes: int | None = None, latency_ms: float = 100.0,
                 sysctls: dict[str, str] | None = None) -> None:
        if not 1 <= n_nodes <= 250:
            raise ValueError(f"n_nodes must be in 1..250, got {n_nodes}")
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        self.tag = tag
        self.rate_mbit = float(rate_mbit)
        self._burst = burst_bytes
        self.burst_bytes = self._burst_for(rate_mbit)
        self.latency_ms = latency_ms
        self.sysctls = dict(sysctls or {})
        self.switch = f"{tag}-sw"
        self.nodes = [SimNode(i, f"{tag}-n{i}", f"{subnet}.{i + 1}", f"p{i}") for i in range(n_nodes)]
        self._created: list[str] = []
        self.destroyed = False

    # -- life cycle ---------------------------------------------------------------------------
    def create(self) -> Topology:
        t0 = time.perf_counter()
        try:
            self._add_ns(self.switch)
            sw = ["ip", "-n", self.switch]
            _run([*sw, "link", "add", "br0", "type", "bridge"])
            _run([*sw, "link", "set", "lo", "up"])
            _run([*sw, "link", "set", "br0", "up"])
            for node in self.nodes:
                self._add_ns(node.ns)
                nd = ["ip", "-n", node.ns]
                _run([*sw, "link", "add", node.port, "type", "veth", "peer", "name", "eth0", "netns", node.ns])
                _run([*sw, "link", "set", node.port, "master", "br0", "up"])
                _run([*nd, "addr", "add", f"{node.ip}/24", "dev", "eth0"])
                _run([*nd, "link", "set", "lo", "up"])
                _run([*nd, "link", "set", "eth0", "up"])
                for key, value in self.sysctls.items():
                    _run(["ip", "netns", "exec", node.ns, "sysctl", "-q", "-w", f"{key}={value}"])
                self._tbf(node.ns, "eth0", "add")
                self._tbf(self.switch, node.port, "add")
        except BaseException:
            self.destroy()
            raise
        logger.info("[netns] %d nodes on %s, links %.0f Mbit/s each way, built in %.2fs",
                    len(self.nodes), self.switch, self.rate_mbit, time.perf_counter() - t0)
        return self

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def _burst_for(self, rate_mbit: float) -> int:
        # default: 4 ms worth of tokens, at least 16 KiB (tbf splits the larger GSO packets veth hands it)
        return self._burst or max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))

    def _tbf(self, ns: str, dev: str, verb: str) -> None:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate",
              f"{self.rate_mbit:g}mbit", "burst", str(self.burst_bytes), "latency", f"{self.latency_ms:g}ms"])

    def set_rate(self, rate_mbit: float) -> None:
        """Change every link's cap, both directions, in place."""
        self.rate_mbit = float(rate_mbit)
        self.burst_bytes = self._burst_for(rate_mbit)
        for node in self.nodes:
            self._tbf(node.ns, "eth0", "change")
            self._tbf(self.switch, node.port, "change")
        logger.info("[netns] links now %.0f Mbit/s each way", self.rate_mbit)

    def destroy(self) -> list[str]:
        """Kill every process in the namespaces and delete them. Idempotent; returns what failed."""
        if self.destroyed or not self._created:
            self.destroyed = True
            return []
        with shielded():
            failed = remove_namespaces(list(reversed(self._created)))
        self.destroyed = True
        if failed:
            logger.error("[netns] could not delete: %s", "; ".join(failed))
        else:
            logger.info("[netns] removed %d namespaces of %s", len(self._created), self.tag)
        return failed

    def __enter__(self) -> Topology:
        return self.create()

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    # -- inspection ---------------------------------------------------------------------------
    def counters(self) -> dict[int, dict[str, int]]:
        """Per node: bytes and packets it sent (``tx``) and received (``rx``) on its link, cumulative."""
        out = _run(["ip", "-n", self.switch, "-s", "-j", "link", "show"])
        by_port = {d["ifname"]: d.get("stats64", {}) for d in json.loads(out.stdout)}
        res = {}
        for node in self.nodes:
            st = by_port.get(node.port)
            if st is None:
                raise NetnsError(f"switch port {node.port} of node {node.index} is missing in {self.switch}")
            res[node.index] = {
                "tx_bytes": int(st["rx"]["bytes"]),  # what the port received is what the node sent
                "rx_bytes": int(st["tx"]["bytes"]),
                "tx_packets": int(st["rx"]["packets"]),
                "rx_packets": int(st["tx"]["packets"]),
            }
        return res

    def qdisc_stats(self) -> dict[int, dict[str, int]]:
        """Per node: tbf drops and overlimits, egress (node side) and ingress (switch side), cumulative."""
        sw = self._tc_stats(self.switch)
        res = {}
        for node in self.nodes:
            eg = self._tc_stats(node.ns).get("eth0", {})
            ing = sw.get(node.port, {})
            res[node.index] = {
                "tx_drops": eg.get("drops", 0), "tx_overlimits": eg.get("overlimits", 0),
                "rx_drops": ing.get("drops", 0), "rx_overlimits": ing.get("overlimits", 0),
            }
        return res

    def tcp_stats(self) -> dict[int, dict[str, int]]:
        """Per node: TCP counters (see ``tcp_counters``), cumulative."""
        return {node.index: tcp_counters(_run(["ip", "netns", "exec", node.ns, "cat", "/proc/net/snmp",
                                               "/proc/net/netstat"]).stdout) for node in self.nodes}

    @staticmethod
    def _tc_stats(ns: str) -> dict[str, dict[str, int]]:
        out = _run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show"])
        return {q["dev"]: {"drops": int(q.get("drops", 0)), "overlimits": int(q.get("overlimits", 0))}
                for q in json.loads(out.stdout or "[]") if q.get("kind") == "tbf"}

    def describe(self) -> dict[str, Any]:
        return {
            "tag": self.tag, "switch_namespace": self.switch, "bridge": "br0",
            "rate_mbit": self.rate_mbit, "burst_bytes": self.burst_bytes, "latency_ms": self.latency_ms,
            "sysctls": self.sysctls,
            "shaping": "tbf on the node's eth0 (egress) and on its switch port (egress toward the node)",
            "nodes": [{"index": n.index, "namespace": n.ns, "ip": n.ip, "switch_port": n.port} for n in self.nodes],
        }


def tcp_counters(text: str) -> dict[str, int]:
    """From ``/proc/net/snmp`` and ``/proc/net/netstat`` (pairs of lines ``Kind: names`` / ``Kind: values``):
    TCP segments retransmitted, retransmission timeouts (each leaves its flow idle for at least the 200 ms
    minimum RTO) and tail-loss probes."""
    fields: dict[str, int] = {}
    lines = text.splitlines()
    for head, vals in zip(lines[::2], lines[1::2]):
        kind, names = head.split(":", 1)
        fields.update({f"{kind}.{k}": int(v) for k, v in zip(names.split(), vals.split(":", 1)[1].split())})
    return {"retrans_segs": fields.get("Tcp.RetransSegs", 0), "rto_timeouts": fields.get("TcpExt.TCPTimeouts", 0),
            "loss_probes": fields.get("TcpExt.TCPLossProbes", 0)}


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP for the duration (a teardown must not be cut short); a no-op outside
    the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
