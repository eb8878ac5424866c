"""Chaos under a stream (issue 22, part 4): a producer process and a consumer process stream samples
through a dock of a controller with a state dir (and no warehouse of its own) and two warehouses with
data dirs, while each kind of process is SIGKILLed in turn and started again: the controller, a
warehouse, the producer, the consumer. At the end the delivery is checked exactly against what the
processes wrote down, fsync'd, as it happened:

- every id whose put was acknowledged reaches the consumer, or (at most one get's worth) was taken
  by a consumer killed in a get whose confirm went out before it wrote the batch down; an id never
  put never comes;
- no id comes twice, except the one thing the documented semantics allow: a batch the consumer
  received whose confirm never reached the controller (the consumer was killed first, or its lease
  expired) is handed out again. The consumer learns which of its batches were confirmed from the
  controller itself: after each get it waits until it holds no lease and compares its `taken`
  count with the one before the get (+n: confirmed; unchanged: the lease expired);
- a put that failed (an exception at the producer) or was cut by the producer's death is not
  acknowledged: its ids may come once, or not at all.

`scripts/soak.py --chaos` runs the same harness for minutes with random kills at random times.
Real `dockd serve` processes and real client processes on loopback."""

from __future__ import annotations

import collections
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest

from dockd.local import read_ready
from tests.conftest import wait_until

PARTITION = "s"
CONSUMER = "c"
WIDTH = 2048  # float32 values per sample: each sample's "x" is its id, repeated
PUT_COUNT = 4  # samples per put
GET_COUNT = 8  # samples per get at most
LEASE_TIMEOUT = 3.0

# -- the worker processes ----------------------------------------------------------------------------
# Each appends one line per event to its log, fsync'd before it goes on, so what a SIGKILLed process
# wrote is exactly what it had done.

PRODUCER = r"""
import os, sys, time
import torch
import dockd
torch.set_num_threads(1)
address, log, base, stop, interval = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def note(line):
    os.write(fd, (line + "\n").encode())
    os.fsync(fd)
note(f"START {os.getpid()}")
with dockd.connect(address) as d:
    i = base
    home = None
    while not os.path.exists(stop):
        ids = list(range(i, i + PUT_COUNT))
        i += PUT_COUNT  # a failed put's ids are never put again: they may or may not be in the dock
        note("T " + " ".join(map(str, ids)))  # tried
        try:
            idx = d.put({"id": ids, "x": [torch.full((WIDTH,), float(k)) for k in ids]}, partition=PARTITION,
                        timeout=20)
        except dockd.DockError as e:
            note(f"F {ids[0]} {type(e).__name__}: {str(e)[:200]!r}")  # failed: not acknowledged
            time.sleep(0.2)
            continue
        note("A " + " ".join(map(str, ids)) + " / " + " ".join(map(str, idx)))  # acknowledged, at these indexes
        if d._router.home != home:
            home = d._router.home
            note(f"H {home}")  # the warehouse its puts go to (the test kills it with a put in flight)
        time.sleep(interval)
note("STOP")
"""

CONSUMER_CODE = r"""
import os, sys, time
import torch
import dockd
torch.set_num_threads(1)
address, log, stop, name, think = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def note(line):
    os.write(fd, (line + "\n").encode())
    os.fsync(fd)

def settled(d):
    # `taken` once this consumer holds no lease (a killed predecessor's lease expires first)
    while True:
        try:
            p = d.stats()["partitions"].get(PARTITION)
        except dockd.DockError:
            time.sleep(0.1)
            continue
        c = (p or {}).get("consumers", {}).get(name)
        if c is None:
            return 0
        if c["leased"] == 0:
            return c["taken"]
        time.sleep(0.02)

note(f"START {os.getpid()}")
with dockd.connect(address) as d:
    taken = settled(d)
    n = 0
    while not os.path.exists(stop):
        try:
            b = d.get(name, ["id", "x"], GET_COUNT, partition=PARTITION, timeout=1, allow_partial=True)
        except (dockd.DockTimeout, dockd.DockNotFound, dockd.DockConnectionError, dockd.DockLeaseError) as e:
            if not isinstance(e, (dockd.DockTimeout, dockd.DockNotFound)):
                note(f"ERR {type(e).__name__}: {str(e)[:200]!r}")
                time.sleep(0.1)
            continue
        except dockd.DockDataLost as e:  # never: a data dir or a replica keeps every acknowledged sample
            note(f"LOST {str(e)[:300]!r}")
            continue
        ok = all(torch.equal(x, torch.full((WIDTH,), float(k))) for k, x in zip(b["id"], b["x"]))
        note(f"R {n} {'ok' if ok else 'BAD'} " + " ".join(map(str, b["id"])) + " / " + " ".join(map(str, b.indexes)))
        time.sleep(think)  # (working on the batch: its confirm goes out meanwhile, by itself)
        now = settled(d)
        if now == taken + len(b.indexes):
            note(f"C {n}")  # confirmed: the controller counts them taken
        elif now == taken:
            note(f"E {n}")  # its lease expired before the confirm reached the controller: handed out again
        else:
            note(f"X {n} {taken} {now} {len(b.indexes)}")
        taken = now
        n += 1
note("STOP")
"""


def _code(body: str) -> str:
    consts = (f"PARTITION = {PARTITION!r}\nPUT_COUNT = {PUT_COUNT}\nGET_COUNT = {GET_COUNT}\nWIDTH = {WIDTH}\n")
    return body.replace("import dockd\n", "import dockd\n" + consts, 1)


# -- the dock and the processes --------------------------------------------------------------------
class ChaosDock:
    """A controller (--state-dir, --no-warehouse) and two warehouses (--data-dir), a producer process
    and a consumer process; each can be SIGKILLed and started again as itself. With `replicas`, the
    controller keeps two copies of each put (--replicas 2) and the warehouses have no data dir: a
    killed one can stay dead."""

    def __init__(self, workdir: str, *, warehouses: int = 2, put_interval: float = 0.02, think: float = 0.03,
                 lease_timeout: float = LEASE_TIMEOUT, replicas: bool = False) -> None:
        self.workdir = workdir
        self.replicas = replicas
        self.put_interval = put_interval
        self.think = think
        self.lease_timeout = lease_timeout
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else workdir
        self.shm_dir = tempfile.mkdtemp(prefix="dockd-chaos-", dir=shm)
        self.state_dir = os.path.join(workdir, "state")
        self.data_dirs = [os.path.join(self.shm_dir, f"wh{i}") for i in range(warehouses)]
        self.logs = os.path.join(workdir, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.stderr = open(os.path.join(workdir, "daemons.log"), "ab")  # noqa: SIM115 - every process's log
        self.ctrl: subprocess.Popen | None = None
        self.ctrl_port = 0
        self.whs: list[subprocess.Popen | None] = [None] * warehouses
        self.wh_ports = [0] * warehouses
        self.producer: subprocess.Popen | None = None
        self.consumer: subprocess.Popen | None = None
        self.incarnations = {"producer": 0, "consumer": 0}
        self.killed: set[str] = set()  # worker logs whose process was SIGKILLed
        try:
            self.start_controller()
            for i in range(warehouses):
                self.start_warehouse(i)
            import dockd

            with dockd.connect(self.address) as d:  # what the consumer confirmed is freed (a long run stays bounded)
                d.create_partition(PARTITION, retire_when_consumed_by=[CONSUMER])
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ctrl_port}"

    # daemons
    def _spawn(self, args: list[str]) -> tuple[subprocess.Popen, dict]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "dockd", "--log-level", "INFO", "serve", *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=self.stderr, env=env)
        return proc, read_ready(proc, timeout=60)

    def start_controller(self) -> None:
        self.ctrl, ready = self._spawn(["--controller", "--no-warehouse", "--state-dir", self.state_dir,
                                        "--port", str(self.ctrl_port), "--lease-timeout", str(self.lease_timeout),
                                        "--warehouse-grace", "60", *(["--replicas", "2"] if self.replicas else [])])
        self.ctrl_port = ready["port"]

    def start_warehouse(self, i: int) -> None:
        keep = [] if self.replicas else ["--data-dir", self.data_dirs[i]]
        self.whs[i], ready = self._spawn(["--join", self.address, *keep, "--capacity", "1GiB",
                                          "--port", str(self.wh_ports[i])])
        self.wh_ports[i] = ready["port"]

    # workers
    def start_producer(self) -> None:
        k = self.incarnations["producer"] = self.incarnations["producer"] + 1
        self.producer = subprocess.Popen(
            [sys.executable, "-c", _code(PRODUCER), self.address, os.path.join(self.logs, f"producer.{k}.log"),
             str(k * 1_000_000), os.path.join(self.workdir, "stop-producer"), str(self.put_interval)],
            stdin=subprocess.DEVNULL, stderr=self.stderr)

    def start_consumer(self) -> None:
        k = self.incarnations["consumer"] = self.incarnations["consumer"] + 1
        self.consumer = subprocess.Popen(
            [sys.executable, "-c", _code(CONSUMER_CODE), self.address, os.path.join(self.logs, f"consumer.{k}.log"),
             os.path.join(self.workdir, "stop-consumer"), CONSUMER, str(self.think)],
            stdin=subprocess.DEVNULL, stderr=self.stderr)

    # kills
    KINDS = ("controller", "warehouse", "producer", "consumer")

    def log_of(self, kind: str) -> str:
        return os.path.join(self.logs, f"{kind}.{self.incarnations[kind]}.log")

    def kill_home_for_good(self) -> None:
        """SIGKILL the producer's home warehouse the moment a put of its is in flight, and never start
        it again (replicas keep its samples)."""
        which = self.producer_home()
        self._wait_for_line(self.log_of("producer"), "T ", 10)
        self._note(f"--- SIGKILL warehouse{which} for good with a put in flight")
        _sigkill(self.whs[which])
        self.whs[which] = None

    def producer_home(self) -> int:
        with open(self.log_of("producer")) as f:
            homes = [ln.split()[1] for ln in f if ln.startswith("H ")]
        return int(homes[-1])

    def kill(self, kind: str, which: int = 0, down: float = 0.0, after: str = "") -> str:
        """SIGKILL one process of `kind` and start it again (`down` seconds later); what was done.
        `after` (a worker): kill it the moment its log gets a new line starting with that (the
        producer's "T": its put is in flight; the consumer's "R": a get returned, its confirm is
        still to go out), within 10 s (else at once)."""
        if after:
            self._wait_for_line(self.log_of(kind), after + " ", 10)
        self._note(f"--- SIGKILL {kind}{which if kind == 'warehouse' else ''}{' after ' + after if after else ''}")
        if kind == "controller":
            _sigkill(self.ctrl)
            time.sleep(down)
            self.start_controller()
            return "controller"
        if kind == "warehouse":
            _sigkill(self.whs[which])
            time.sleep(down)
            self.start_warehouse(which)
            return f"warehouse {which}"
        proc = self.producer if kind == "producer" else self.consumer
        self.killed.add(self.log_of(kind))
        _sigkill(proc)
        time.sleep(down)
        (self.start_producer if kind == "producer" else self.start_consumer)()
        return kind

    @staticmethod
    def _wait_for_line(path: str, prefix: str, timeout: float) -> bool:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            deadline = time.monotonic() + timeout
            tail = b""
            while time.monotonic() < deadline:
                tail += f.read()
                if tail.endswith(b"\n") and tail.rsplit(b"\n", 2)[-2].startswith(prefix.encode()):
                    return True
                tail = tail[-4096:]
                time.sleep(0.0005)
        return False

    def _note(self, line: str) -> None:
        self.stderr.write(f"{time.strftime('%H:%M:%S')} {line}\n".encode())
        self.stderr.flush()

    def check_alive(self) -> None:
        """Fail when a process died on its own."""
        for what, p in [("controller", self.ctrl), *((f"warehouse {i}", w) for i, w in enumerate(self.whs)),
                        ("producer", self.producer), ("consumer", self.consumer)]:
            if p is not None and p.poll() is not None:
                raise AssertionError(f"the {what} exited by itself with code {p.returncode}; see {self.stderr.name}")

    # the end
    def drain(self, timeout: float) -> Accounting:
        """Stop the producer, let the consumer take what is left, stop it; the accounting."""
        open(os.path.join(self.workdir, "stop-producer"), "w").close()
        assert self.producer is not None
        self.producer.wait(60)
        deadline = time.monotonic() + timeout
        while True:
            acc = account(self.logs, self.killed)
            if not acc.undelivered or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        open(os.path.join(self.workdir, "stop-consumer"), "w").close()
        assert self.consumer is not None
        self.consumer.wait(60)
        acc = account(self.logs, self.killed)
        if acc.undelivered:  # which of them the controller says the consumer took (killed before it wrote them down)
            acc = account(self.logs, self.killed, available=self.available())
        return acc

    def available(self) -> set[int]:
        """Indexes of PARTITION the consumer could still get (the controller's word)."""
        import dockd

        out: set[int] = set()
        with dockd.connect(self.address) as d:
            start = 0
            while True:
                got = d.list(PARTITION, CONSUMER, limit=1000, start=start)["indexes"]
                out.update(got)
                if len(got) < 1000:
                    return out
                start = got[-1] + 1

    def close(self) -> None:
        for p in (self.producer, self.consumer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(20)
        for p in [*self.whs, self.ctrl]:
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(20)
            if p is not None and p.stdout is not None:
                p.stdout.close()
        self.stderr.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def _sigkill(p: subprocess.Popen | None) -> None:
    assert p is not None and p.poll() is None, "the process to kill is not running"
    p.send_signal(signal.SIGKILL)
    p.wait(20)
    if p.stdout is not None:
        p.stdout.close()


# -- the accounting --------------------------------------------------------------------------------
@dataclass
class Accounting:
    tried: int = 0
    acked: int = 0
    failed_puts: int = 0  # puts that raised: not acknowledged
    cut_puts: int = 0  # puts a killed producer had tried without an answer
    delivered: int = 0  # deliveries (batches' samples) the consumer wrote down
    distinct: int = 0
    batches: int = 0
    unconfirmed_batches: int = 0  # received, never confirmed: the consumer was killed first
    expired_batches: int = 0  # received, lease expired before the confirm reached the controller
    allowed_duplicates: int = 0
    unexplained_duplicates: list[str] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)  # delivered, never put
    bad_values: list[str] = field(default_factory=list)
    undelivered: list[int] = field(default_factory=list)  # acknowledged, not (yet) delivered
    unrecorded: list[int] = field(default_factory=list)  # taken by a consumer killed before it wrote them down
    lost: list[int] = field(default_factory=list)  # acknowledged and neither delivered nor taken
    reported_lost: list[str] = field(default_factory=list)  # DockDataLost at the consumer
    odd_confirms: list[str] = field(default_factory=list)  # `taken` moved by another amount than the batch
    errors: collections.Counter = field(default_factory=collections.Counter)

    def violations(self) -> list[str]:
        v = []
        if self.unexplained_duplicates:
            v.append(f"{len(self.unexplained_duplicates)} unexplained duplicates: {self.unexplained_duplicates[:5]}")
        if self.unknown:
            v.append(f"{len(self.unknown)} ids delivered that were never put: {self.unknown[:10]}")
        if self.bad_values:
            v.append(f"{len(self.bad_values)} batches with wrong values: {self.bad_values[:3]}")
        if self.lost:
            v.append(f"{len(self.lost)} acknowledged ids never delivered: {self.lost[:20]}")
        if self.reported_lost:
            v.append(f"{len(self.reported_lost)} gets raised DockDataLost: {self.reported_lost[:2]}")
        if self.odd_confirms:
            v.append(f"the consumer's taken count moved oddly: {self.odd_confirms[:5]}")
        return v

    def summary(self) -> str:
        return (f"acked {self.acked} of {self.tried} ids tried ({self.failed_puts} puts failed, {self.cut_puts} cut by "
                f"a kill); delivered {self.delivered} in {self.batches} batches ({self.distinct} distinct); "
                f"duplicates allowed {self.allowed_duplicates} ({self.unconfirmed_batches} batches unconfirmed at a "
                f"consumer's death, {self.expired_batches} expired), unexplained {len(self.unexplained_duplicates)}; "
                f"taken unrecorded {len(self.unrecorded)}; lost {len(self.lost)}; never put {len(self.unknown)}; "
                f"transient errors {dict(self.errors)}")


def account(logdir: str, killed: set[str], available: set[int] | None = None) -> Accounting:
    """The delivery accounting from the workers' logs. `killed`: the logs of SIGKILLed workers;
    `available`: the indexes the consumer could still get (the controller's word), to tell ids a killed
    consumer took without writing them down from ids lost."""
    acc = Accounting()
    tried: set[int] = set()
    acked: dict[int, int] = {}  # id -> index
    names = sorted(os.listdir(logdir), key=lambda n: (n.split(".")[0], int(n.split(".")[1])))
    deliveries: dict[int, list[tuple[bool, str]]] = collections.defaultdict(list)  # id -> [(confirmed, where)]
    between_gets = 0  # consumers killed outside a batch's R..C: only they may have taken ids unwritten
    for name in names:
        path = os.path.join(logdir, name)
        with open(path) as f:
            lines = [ln.split() for ln in f.read().splitlines() if ln]
        if name.startswith("producer"):
            pending: list[int] = []
            for ln in lines:
                if ln[0] == "T":
                    pending = [int(x) for x in ln[1:]]
                    tried.update(pending)
                elif ln[0] == "A":
                    cut = ln.index("/")
                    acked.update(zip((int(x) for x in ln[1:cut]), (int(x) for x in ln[cut + 1:])))
                    pending = []
                elif ln[0] == "F":
                    acc.failed_puts += 1
                    acc.errors["put " + ln[2].rstrip(":")] += 1
                    pending = []
            if pending and path in killed:
                acc.cut_puts += 1
            continue
        batches: dict[str, list[int]] = {}
        confirmed: set[str] = set()
        expired: set[str] = set()
        for ln in lines:
            if ln[0] == "R":
                cut = ln.index("/")
                batches[ln[1]] = [int(x) for x in ln[3:cut]]
                if ln[2] != "ok":
                    acc.bad_values.append(f"{name} batch {ln[1]}: {ln[3:cut]}")
            elif ln[0] == "C":
                confirmed.add(ln[1])
            elif ln[0] == "E":
                acc.expired_batches += 1
                expired.add(ln[1])
            elif ln[0] == "X":
                acc.odd_confirms.append(f"{name} batch {ln[1]}: taken {ln[2]} -> {ln[3]} for {ln[4]} samples")
            elif ln[0] == "LOST":
                acc.reported_lost.append(" ".join(ln[1:]))
            elif ln[0] == "ERR":
                acc.errors["get " + ln[1].rstrip(":")] += 1
        if path in killed and (not batches or list(batches)[-1] in confirmed | expired):
            between_gets += 1  # done with its last batch when killed: maybe in a get whose confirm went out
        for b, ids in batches.items():
            acc.batches += 1
            acc.unconfirmed_batches += b not in confirmed and path in killed
            for k in ids:
                deliveries[k].append((b in confirmed, f"{name}#{b}"))
    acc.tried, acc.acked = len(tried), len(acked)
    acc.delivered = sum(len(v) for v in deliveries.values())
    acc.distinct = len(deliveries)
    for k, ds in sorted(deliveries.items()):
        if k not in tried:
            acc.unknown.append(k)
        # every delivery but the last must be one whose confirm never reached the controller
        if any(ok for ok, _ in ds[:-1]):
            acc.unexplained_duplicates.append(f"id {k}: " + ", ".join(f"{w}{'' if ok else '(unconfirmed)'}"
                                                                      for ok, w in ds))
        else:
            acc.allowed_duplicates += len(ds) - 1
    acc.undelivered = sorted(k for k in acked if k not in deliveries)
    if available is not None:
        for k in acc.undelivered:
            (acc.lost if acked[k] in available else acc.unrecorded).append(k)
        # a consumer killed between a get whose confirm went out and its note: at most one get's worth per
        # such kill (one killed between a batch's R and C line was not in a get)
        if len(acc.unrecorded) > GET_COUNT * between_gets:
            acc.lost += acc.unrecorded
            acc.unrecorded = []
    else:
        acc.lost = list(acc.undelivered)
    return acc


_counted: dict[str, tuple[int, int]] = {}  # consumer log -> (bytes read, samples in them)


def delivered_count(logdir: str) -> int:
    """Samples the consumers wrote down so far (reads only what each log gained since the last call)."""
    n = 0
    for name in os.listdir(logdir):
        if name.startswith("consumer"):
            path = os.path.join(logdir, name)
            offset, count = _counted.get(path, (0, 0))
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            whole = chunk[:chunk.rfind(b"\n") + 1]
            count += sum(ln.split().index(b"/") - 3 for ln in whole.splitlines() if ln.startswith(b"R "))
            _counted[path] = (offset + len(whole), count)
            n += count
    return n


def wait_progress(dock: ChaosDock, samples: int, timeout: float) -> None:
    """Wait until the consumer wrote down `samples` more samples (and everyone is alive)."""
    start = delivered_count(dock.logs)
    deadline = time.monotonic() + timeout
    while delivered_count(dock.logs) < start + samples:
        dock.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"the stream did not make progress for {timeout:g}s (delivered "
                                 f"{delivered_count(dock.logs) - start} of {samples}); see {dock.stderr.name}")
        time.sleep(0.1)


# -- the tests --------------------------------------------------------------------------------------
def stream_through(dock: ChaosDock, steps) -> Accounting:
    """Run the producer and the consumer through `steps` (each followed by 40 more samples delivered),
    drain, and check the accounting; the dock is closed in the end."""
    try:
        dock.start_producer()
        dock.start_consumer()
        wait_progress(dock, 40, 60)
        for step in steps:
            step()
            wait_progress(dock, 40, 60)
        acc = dock.drain(timeout=30)
    finally:
        dock.close()
    print(acc.summary())
    assert not acc.violations(), "\n".join(acc.violations()) + f"\n{acc.summary()}\nlogs: {dock.workdir}"
    return acc


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_each_kind_in_turn_is_exactly_once(tmp_path):
    dock = ChaosDock(str(tmp_path))
    kills = (("controller", 0, ""), ("warehouse", 0, ""), ("producer", 0, "T"), ("consumer", 0, "R"),
             ("warehouse", 1, ""), ("producer", 0, ""), ("consumer", 0, ""), ("controller", 0, ""))
    acc = stream_through(dock, [functools.partial(dock.kill, kind, which, after=after) for kind, which, after in kills])
    assert acc.acked >= 200 and acc.distinct + len(acc.unrecorded) >= acc.acked
    assert acc.cut_puts >= 1  # the producer killed with its put in flight


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_warehouses_killed_for_good_lose_nothing_with_replicas(tmp_path):
    """--replicas 2, warehouses without data dirs: two of three warehouses are SIGKILLed and never
    come back (each with the producer's put in flight to it), the controller is SIGKILLed and
    restarted on its state dir; every acknowledged sample is delivered, none twice, no DockDataLost."""
    import dockd

    dock = ChaosDock(str(tmp_path), warehouses=3, replicas=True)

    def repaired() -> None:
        def done() -> bool:
            with dockd.connect(dock.address) as d:
                return d.stats()["partitions"][PARTITION]["under_replicated"] == 0

        wait_until(done, 30, "every value on two warehouses again")

    acc = stream_through(dock, [dock.kill_home_for_good, repaired, functools.partial(dock.kill, "controller"), repaired,
                                dock.kill_home_for_good])
    assert acc.acked >= 150 and acc.distinct + len(acc.unrecorded) >= acc.acked
