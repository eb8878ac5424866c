"""`scripts/soak.py --chaos`: the chaos test's dock (tests/reliability/test_chaos.py) under random
SIGKILLs for minutes, with the variants soak.py's --help lists (--commit-window, --no-data-dirs,
--prefetch, --kinds), and the delivery accounting; see soak.py's docstring."""

from __future__ import annotations

import collections
import os
import random
import re
import shutil
import sys
import tempfile
import time
import types


def chaos_harness():
    """The chaos test's module (tests/reliability/test_chaos.py), loaded from this checkout."""
    import importlib.util

    # (by path: a `tests` package installed in site-packages, as some packages ship one, would shadow
    # the checkout's; the module itself imports tests.conftest, so `tests` is made the checkout's)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests = types.ModuleType("tests")
    tests.__path__ = [os.path.join(root, "tests")]
    sys.modules["tests"] = tests
    spec = importlib.util.spec_from_file_location("dockd_chaos_harness", os.path.join(root, "tests", "reliability",
                                                                                       "test_chaos.py"))
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness
    spec.loader.exec_module(harness)
    return harness


def consumer_code(code: str, prefetch: int) -> str:
    """The chaos consumer's code with its DockDataLost notes naming every index (the message names the
    first 16 at most, or none) and, with `prefetch`, its gets taking leases ahead; its wait for the end
    of a batch's lease (confirmed or expired) then counts the samples it holds ahead, not handed out
    yet, as no lease of its (a window's leases the controller expired meanwhile make `leased` smaller)."""
    lost, get, idle = 'note(f"LOST {str(e)[:300]!r}")', "allow_partial=True)", 'if c["leased"] == 0:'
    assert code.count(lost) == code.count(get) == code.count(idle) == 1, "the chaos consumer changed: update soak.py"
    code = code.replace(lost, 'note(f"LOST {sorted(e.indexes)} {str(e)[:300]!r}")')
    if not prefetch:
        return code
    held = ("def held(d):  # samples of the leases this client took ahead and has not handed out\n"
            "    return sum(len(lease.indexes) for lease in list(d._confirms._held.values()))\n\n")
    code = code.replace(get, f"allow_partial=True, prefetch={prefetch})").replace(idle, 'if c["leased"] <= held(d):')
    return code.replace("def settled(d):", held + "def settled(d):", 1)


def puts_by_warehouse(logdir: str) -> tuple[dict[int, int], dict[int, int]]:
    """From the producers' logs: each acknowledged id's index, and the id of the warehouse that answered
    its put (the producer's home after it: an "H" line follows the put that changed it)."""
    index: dict[int, int] = {}
    where: dict[int, int] = {}
    for name in sorted(os.listdir(logdir)):
        if not name.startswith("producer"):
            continue
        home, last = -1, []
        with open(os.path.join(logdir, name)) as f:
            for ln in (line.split() for line in f.read().splitlines() if line):
                if ln[0] == "A":
                    cut = ln.index("/")
                    last = [int(x) for x in ln[1:cut]]
                    index.update(zip(last, (int(x) for x in ln[cut + 1:])))
                    where.update((k, home) for k in last)
                elif ln[0] == "H":
                    home = int(ln[1])
                    where.update((k, home) for k in last)
    return index, where


def lost_indexes(report: str) -> set[int] | None:
    """The indexes a DockDataLost note names (`consumer_code`), None if it names none."""
    m = re.match(r"\[([0-9, ]*)\]", report)
    return None if m is None else {int(x) for x in m.group(1).replace(",", " ").split()}


def odd_duplicates(logdir: str) -> list[str]:
    """Ids delivered again after a batch whose confirm moved the consumer's `taken` by another amount
    than the batch (an "X" line): the harness allows a repeat of any batch not confirmed, but such a
    batch was confirmed, only not as the samples delivered, so nothing excuses its repeats."""
    odd: dict[int, str] = {}
    out = []
    for name in sorted(os.listdir(logdir), key=lambda n: (n.split(".")[0], int(n.split(".")[1]))):
        if not name.startswith("consumer"):
            continue
        with open(os.path.join(logdir, name)) as f:
            lines = [ln.split() for ln in f.read().splitlines() if ln]
        batches = {ln[1]: [int(x) for x in ln[3:ln.index("/")]] for ln in lines if ln[0] == "R"}
        for ln in lines:
            if ln[0] == "R":
                out += [f"id {k}: {odd[k]}, again in {name}#{ln[1]}" for k in batches[ln[1]] if k in odd]
            elif ln[0] == "X":
                odd.update((k, f"{name}#{ln[1]} (taken {ln[2]} -> {ln[3]} for {ln[4]})") for k in batches[ln[1]])
    return out


def soak_dock(harness, args):
    """The chaos dock with this run's warehouse flags: --commit-window, --no-data-dirs."""

    class SoakDock(harness.ChaosDock):
        excused: dict[int, int] = {}  # warehouse id -> acknowledged ids it lost (--no-data-dirs)
        early = 0  # puts answered before their commit by the warehouses killed so far
        metrics: dict[int, int] = {}  # a warehouse's pid -> its metrics port (--commit-window)

        def _spawn(self, argv: list[str]):
            warehouse = "--join" in argv
            if warehouse and args.no_data_dirs:
                k = argv.index("--data-dir")
                argv = argv[:k] + argv[k + 2:]
            if warehouse and args.commit_window:
                argv = [*argv, "--commit-window", str(args.commit_window), "--metrics-port", "0"]
            proc, ready = super()._spawn(argv)
            if warehouse and args.commit_window:
                self.metrics[proc.pid] = ready["metrics_port"]
            return proc, ready

        def answered_early(self, proc) -> int:
            """dockd_puts_before_commit_total of a warehouse process (--commit-window)."""
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics[proc.pid]}/metrics", timeout=10) as r:
                text = r.read().decode()
            return int(float(re.search(r"^dockd_puts_before_commit_total (\S+)$", text, re.M).group(1)))

        def kill(self, kind: str, which: int = 0, down: float = 0.0, after: str = "") -> str:
            if kind == "warehouse" and args.commit_window:
                self.early += self.answered_early(self.whs[which])
            return super().kill(kind, which, down=down, after=after)

        def all_answered_early(self) -> int:
            """Puts answered before their commit by every warehouse process of the run."""
            return self.early + sum(self.answered_early(w) for w in self.whs if w is not None)

        def drain(self, timeout: float):
            """The harness's drain; without data dirs done once every acknowledged id is delivered or was
            answered by a warehouse process that is gone (those may be lost: excused, counted apart)."""
            if not args.no_data_dirs:
                return super().drain(timeout)
            import dockd

            open(os.path.join(self.workdir, "stop-producer"), "w").close()
            self.producer.wait(60)
            index, where = puts_by_warehouse(self.logs)
            with dockd.connect(self.address) as d:
                live = {int(w) for w, e in d.stats()["warehouses"].items() if e["state"] == "joined"}
            gone = {k for k, w in where.items() if w not in live}
            deadline = time.monotonic() + timeout
            while set(harness.account(self.logs, self.killed).undelivered) - gone and time.monotonic() < deadline:
                time.sleep(0.2)
            open(os.path.join(self.workdir, "stop-consumer"), "w").close()
            self.consumer.wait(60)
            # an excusable id the controller still lists counts as lost too: it is taken out below
            acc = harness.account(self.logs, self.killed, available=self.available() | {index[k] for k in gone})
            excused = [k for k in acc.lost if k in gone]
            acc.lost = [k for k in acc.lost if k not in gone]
            self.excused = dict(collections.Counter(where[k] for k in excused))
            # a DockDataLost may name only indexes of excusable ids, or of puts never acknowledged
            allowed, acked = {index[k] for k in gone}, set(index.values())
            unexplained = []
            for report in acc.reported_lost:
                named = lost_indexes(report)
                if not named or any(i in acked and i not in allowed for i in named):
                    unexplained.append(report)
            print(f"without data dirs: {len(acc.reported_lost)} gets raised DockDataLost ({len(unexplained)} naming "
                  f"an acknowledged index not excused, or none); acknowledged ids answered by a warehouse process "
                  f"killed since: {len(gone)}, of them lost {len(excused)} (by warehouse id: {self.excused})",
                  flush=True)
            acc.reported_lost = unexplained
            return acc

    return SoakDock


def chaos(args) -> int:
    """--chaos: random SIGKILLs of random daemons and workers under a stream; the delivery accounting."""
    harness = chaos_harness()
    delivered_count, wait_progress = harness.delivered_count, harness.wait_progress
    harness.CONSUMER_CODE = consumer_code(harness.CONSUMER_CODE, args.prefetch)
    kinds = tuple(args.kinds.split(","))

    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="dockd-chaos-soak-")
    print(f"chaos soak: {args.minutes:g} min, a kill every {args.min_gap:g}..{args.max_gap:g} s of one of {kinds} "
          f"(seed {args.seed}); warehouses {'without' if args.no_data_dirs else 'with'} data dirs"
          f"{f', commit window {args.commit_window:g} s' if args.commit_window else ''}"
          f"{f'; consumer prefetch {args.prefetch}' if args.prefetch else ''}; logs in {workdir}", flush=True)
    dock = soak_dock(harness, args)(workdir)
    kills: collections.Counter = collections.Counter()
    acc = None
    stalled = ""
    try:
        dock.start_producer()
        dock.start_consumer()
        wait_progress(dock, 40, args.stall)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            at = min(end, time.monotonic() + rng.uniform(args.min_gap, args.max_gap))
            while time.monotonic() < at:
                dock.check_alive()
                time.sleep(max(0.0, min(0.5, at - time.monotonic())))
            if time.monotonic() >= end:
                break
            kind = rng.choice(kinds)
            which = rng.randrange(len(dock.whs)) if kind == "warehouse" else 0
            after = ""
            if kind in ("producer", "consumer") and rng.random() < 0.5:
                after = "T" if kind == "producer" else "R"
            down = rng.choice((0.0, 0.0, rng.uniform(0, 3)))
            killed_at = time.monotonic()
            what = dock.kill(kind, which, down=down, after=after)
            kills[kind] += 1
            line = (f"[{killed_at - t0:6.1f}s] SIGKILL {what}{' after ' + after if after else ''}"
                    f"{f', down {down:.1f}s' if down else ''}")
            try:
                wait_progress(dock, 8, args.stall)
            except AssertionError as e:
                stalled = f"after the SIGKILL of the {what}: {e}"
                print(f"{line}: STALL {e}", flush=True)
                break
            print(f"{line}; delivering again after {time.monotonic() - killed_at:.1f}s; "
                  f"delivered so far {delivered_count(dock.logs)}", flush=True)
        if not stalled:
            acc = dock.drain(timeout=args.stall)
            if args.commit_window:
                print(f"puts answered before their commit: {dock.all_answered_early()}", flush=True)
    finally:
        dock.close()
    with open(dock.stderr.name) as f:  # how the controller learnt of each warehouse death
        reasons = collections.Counter(re.findall(r"\[controller\] warehouse (lost|away) id=.*reason='([^']*)'", f.read()))
    print(f"\nkills: {dict(kills)} ({sum(kills.values())}); the controller's log: "
          + (", ".join(f"warehouse {what} ({why}) x{n}" for (what, why), n in sorted(reasons.items())) or "-"))
    problems = [stalled] if stalled else []
    if acc is not None:
        print(acc.summary())
        problems += acc.violations()
        again = odd_duplicates(dock.logs)
        if again:
            problems.append(f"{len(again)} ids delivered again after a batch confirmed as other samples: {again[:3]}")
    for line in problems:
        print("VIOLATION " + line)
    if problems:
        print(f"logs kept in {workdir}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
