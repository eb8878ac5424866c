"""The ramp: start the daemons and the client processes, offer rising request rates, read the CPU counters.

One step = every client process issues its share of the offered rate for
``step_s`` seconds, open loop, starting together; the CPU counters of the
controller daemon(s), the warehouse daemons, the client processes and the
machine are read just before the step starts and after every process has
answered (so the CPU of every request of the step is inside the window;
between steps the daemons only exchange heartbeats).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import selectors
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..common import REPO_ROOT, spawn_env
from .daemons import Daemons, multi_controller_support, pin
from .procstat import cpu_seconds, machine_cpu

logger = logging.getLogger(__name__)

MEAN_GET = 4.5
"""Mean samples per get (uniform 1..8)."""


@dataclass
class LoadConfig:
    controllers: tuple[int, ...] = (1,)
    warehouses: int = 2
    procs: int = 3
    """Client processes."""
    rollouts: int = 24
    """Rollout workers (AsyncDock each), spread over the client processes."""
    trainers: int = 12
    """Trainer workers (AsyncDock each), spread over the client processes."""
    partitions: int = 8
    """Stream partitions (spread over the controllers when K > 1)."""
    consumers: int = 2
    """Consumer names; each takes every sample of its partitions."""
    tokens_bytes: int = 4096
    logp_bytes: int = 2048
    consume_fraction: float = 0.9
    """Samples the consumers take, as a fraction of those put (the rest accumulate, so gets rarely wait)."""
    prefill: int = 256
    """Samples put into every partition before the ramp."""
    rates: tuple[float, ...] = (100, 200, 300, 400, 600, 800, 1000, 1300, 1600, 2000, 2500, 3200, 4000)
    """Offered requests/s (puts + gets), in order; the ramp stops after two overloaded steps in a row."""
    step_s: float = 6.0
    p99_ms: float = 10.0
    achieved_min: float = 0.95
    """A step passes when p99 <= p99_ms and answered/offered >= this, with no errors."""
    overload_p99_factor: float = 5.0
    """A step is overloaded when its p99 exceeds this many times p99_ms or it answers < 90 % of the offered
    requests (or has late requests); two overloaded steps in a row end the ramp."""
    netns: bool = False
    controller_cpus: str = ""
    warehouse_cpus: str = ""
    client_cpus: str = ""
    capacity: str = "2GiB"
    max_concurrency: int = 16
    """Threads of each AsyncDock."""
    quick: bool = False

    def __post_init__(self) -> None:
        if self.procs < 1 or self.rollouts < 1 or self.trainers < 1 or self.warehouses < 1:
            raise ValueError("procs, rollouts, trainers and warehouses must be >= 1")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if any(k < 1 for k in self.controllers):
            raise ValueError(f"controllers must be >= 1, got {self.controllers}")
        if not 0 < self.consume_fraction <= 1:
            raise ValueError("consume_fraction must be in (0, 1]")

    @classmethod
    def quick_config(cls, **over: Any) -> LoadConfig:
        values: dict[str, Any] = dict(quick=True, warehouses=1, procs=1, rollouts=2, trainers=2, partitions=2,
                                      prefill=32, rates=(40, 80), step_s=1.5)
        values.update(over)
        return cls(**values)

    @property
    def get_share(self) -> float:
        """Gets per put: every put's sample is taken by each consumer (times consume_fraction), MEAN_GET at a time."""
        return self.consumers * self.consume_fraction / MEAN_GET

    def split(self, rate: float) -> tuple[float, float]:
        """(puts/s, gets/s) of an offered rate of requests/s."""
        g = self.get_share
        return rate / (1 + g), rate * g / (1 + g)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _share(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class ClientProc:
    def __init__(self, index: int, prefix: list[str], log: Path, cpus: set[int] | None,
                 env: dict[str, str] | None = None) -> None:
        self.index = index
        self.log = log
        cmd = [*prefix, sys.executable, "-m", "benchmarks.controller_load.worker"]
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         cwd=str(REPO_ROOT), env=dict(spawn_env(), PYTHONUNBUFFERED="1", **(env or {})), bufsize=0)
        pin(self.proc.pid, cpus)
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")

    def receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"client process {self.index} sent no reply within {timeout:g}s; "
                                   f"log: {self._tail()}")
            if self._sel.select(min(left, 1.0)):
                chunk = os.read(self.proc.stdout.fileno(), 1 << 22)
                if not chunk:
                    raise RuntimeError(f"client process {self.index} exited ({self.proc.wait()}); log: {self._tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"client process {self.index}: {reply.get('error')}")
        return reply

    def _tail(self) -> str:
        try:
            return self.log.read_bytes()[-1500:].decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.receive(10.0)
            except Exception:  # noqa: BLE001 - it is stopped below anyway
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for s in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                s.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def summarize_step(rate: float, cfg: LoadConfig, replies: list[dict[str, Any]], cpu: dict[str, float],
                   wall_s: float) -> dict[str, Any]:
    lat = {"put": [], "get": []}
    offered = {"put": 0, "get": 0}
    errors: dict[str, int] = {}
    late = dropped = samples_got = 0
    behind = 0.0
    for r in replies:
        for k in lat:
            lat[k] += r["latencies_s"][k]
            offered[k] += r["offered"][k]
            dropped += r["dropped"][k]
        for e, c in r["errors"].items():
            errors[e] = errors.get(e, 0) + c
        late += r["late"]
        samples_got += r["samples_got"]
        behind = max(behind, r["scheduler_behind_max_s"])
    n_err = sum(errors.values())
    answered = len(lat["put"]) + len(lat["get"]) - late
    every = lat["put"] + lat["get"]
    n_off = offered["put"] + offered["get"]
    out: dict[str, Any] = {
        "offered_rps": rate,
        "offered_requests": n_off,
        "answered": answered,
        "achieved_rps": answered / cfg.step_s,
        "achieved_fraction": answered / n_off if n_off else None,
        "puts": len(lat["put"]), "gets": len(lat["get"]), "samples_got": samples_got,
        "errors": errors, "late": late, "dropped": dropped,
        "scheduler_behind_max_ms": behind * 1e3,
        "wall_s": wall_s,
    }
    for name, vals in (("all", every), ("put", lat["put"]), ("get", lat["get"])):
        out[f"{name}_p50_ms"] = None if not vals else _pct(vals, 0.5) * 1e3
        out[f"{name}_p99_ms"] = None if not vals else _pct(vals, 0.99) * 1e3
    out["cpu_s"] = cpu
    per = max(1, answered)
    out["controller_cpu_us_per_request"] = cpu["controller"] / per * 1e6
    out["warehouse_cpu_us_per_request"] = cpu["warehouses"] / per * 1e6
    out["client_cpu_us_per_request"] = cpu["clients"] / per * 1e6
    out["controller_cores_busy"] = cpu["controller"] / wall_s
    out["warehouse_cores_busy"] = cpu["warehouses"] / wall_s
    out["client_cores_busy"] = cpu["clients"] / wall_s
    out["machine_busy_fraction"] = cpu["machine_busy"] / cpu["machine_total"] if cpu["machine_total"] else None
    out["passed"] = bool(out["all_p99_ms"] is not None and out["all_p99_ms"] <= cfg.p99_ms
                         and (out["achieved_fraction"] or 0) >= cfg.achieved_min and not n_err and not late)
    return out


def ramp_one(k: int, cfg: LoadConfig, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Every rate step against K controllers; the result dict of that K."""
    from .daemons import parse_cpus

    res: dict[str, Any] = {"controllers": k, "status": "ok", "steps": []}
    if k > 1:
        how, why = multi_controller_support()
        res["multi_controller"] = {"how": how, "why": why}
        if how is None:
            res["status"] = "skipped"
            res["reason"] = why
            log(f"[controller_load] K={k}: skipped: {why}")
            return res
    daemons = Daemons(controllers=k, warehouses=cfg.warehouses, capacity=cfg.capacity, netns=cfg.netns,
                      controller_cpus=parse_cpus(cfg.controller_cpus), warehouse_cpus=parse_cpus(cfg.warehouse_cpus),
                      workdir=workdir)
    clients: list[ClientProc] = []
    try:
        res["layout"] = daemons.layout
        res["controller_addresses"] = daemons.controller_addresses
        client_cpus = parse_cpus(cfg.client_cpus)
        parts = [f"stream{i}" for i in range(cfg.partitions)]
        consumers = [f"trainer{i}" for i in range(cfg.consumers)]
        roll, train = _share(cfg.rollouts, cfg.procs), _share(cfg.trainers, cfg.procs)
        for j in range(cfg.procs):
            clients.append(ClientProc(j, daemons.client_prefix(j), workdir / f"client{j}.log", client_cpus,
                                      daemons.client_env))
        first_r = first_t = 0
        for j, c in enumerate(clients):
            # rollout and trainer indexes are global, so partitions and consumers spread over all processes
            wh = j % cfg.warehouses
            c.send({"cmd": "setup", "address": daemons.address, "rollouts": roll[j], "trainers": train[j],
                    "first_rollout": first_r, "first_trainer": first_t, "partitions": parts,
                    "consumers": consumers, "tokens_bytes": cfg.tokens_bytes, "logp_bytes": cfg.logp_bytes,
                    "max_concurrency": cfg.max_concurrency, "warehouse": daemons.warehouse_addresses[wh]})
            c.receive(120.0)
            first_r += roll[j]
            first_t += train[j]
        for c in clients:
            c.send({"cmd": "prefill", "per_partition": math.ceil(cfg.prefill / cfg.procs)})
        for c in clients:
            c.receive(300.0)
        ctl_pids, wh_pids = daemons.controller_pids, daemons.warehouse_pids
        cl_pids = [c.pid for c in clients]
        failing = 0
        for rate in cfg.rates:
            put_rate, get_rate = cfg.split(rate)
            start_at = time.monotonic() + 0.3
            for j, c in enumerate(clients):
                c.send({"cmd": "step", "put_rate": put_rate * roll[j] / cfg.rollouts,
                        "get_rate": get_rate * train[j] / cfg.trainers, "start_at": start_at,
                        "duration": cfg.step_s})
            time.sleep(max(0.0, start_at - time.monotonic() - 0.05))
            c0 = {"controller": cpu_seconds(ctl_pids), "warehouses": cpu_seconds(wh_pids),
                  "clients": cpu_seconds(cl_pids)}
            m0 = machine_cpu()
            t0 = time.monotonic()
            replies = [c.receive(cfg.step_s + 120.0) for c in clients]
            wall = time.monotonic() - t0
            m1 = machine_cpu()
            cpu = {"controller": cpu_seconds(ctl_pids) - c0["controller"],
                   "warehouses": cpu_seconds(wh_pids) - c0["warehouses"],
                   "clients": cpu_seconds(cl_pids) - c0["clients"],
                   "machine_busy": m1[0] - m0[0], "machine_total": m1[1] - m0[1]}
            step = summarize_step(rate, cfg, replies, cpu, wall)
            res["steps"].append(step)
            log(f"[controller_load] K={k} offered {rate:,.0f}/s: answered {step['achieved_rps']:,.0f}/s, "
                f"p50 {step['all_p50_ms']:.2f} ms, p99 {step['all_p99_ms']:.2f} ms, controller "
                f"{step['controller_cpu_us_per_request']:.0f} us/req ({step['controller_cores_busy']:.2f} cores), "
                f"warehouses {step['warehouse_cpu_us_per_request']:.0f} us/req, clients "
                f"{step['client_cpu_us_per_request']:.0f} us/req, machine {step['machine_busy_fraction']:.0%} busy"
                f"{'' if step['passed'] else '  [fails]'}")
            over = (step["all_p99_ms"] is None or step["all_p99_ms"] > cfg.p99_ms * cfg.overload_p99_factor
                     or (step["achieved_fraction"] or 0) < 0.9 or step["late"] > 0)
            failing = failing + 1 if over else 0
            if failing >= 2:
                break
        res["sustained"] = sustained(res["steps"])
    except Exception as e:  # noqa: BLE001 - one K failing does not lose the others
        res["status"] = "failed"
        res["error"] = f"{type(e).__name__}: {e}"
        logger.exception("[controller_load] K=%d failed", k)
        log(f"[controller_load] K={k} failed: {e}; logs in {workdir}")
    finally:
        for c in clients:
            c.close()
        daemons.close()
    return res


def sustained(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The passing step with the highest answered rate (None when none passed)."""
    ok = [s for s in steps if s["passed"]]
    if not ok:
        return None
    best = max(ok, key=lambda s: s["achieved_rps"])
    return {"offered_rps": best["offered_rps"], "achieved_rps": best["achieved_rps"],
            "step_index": steps.index(best)}
