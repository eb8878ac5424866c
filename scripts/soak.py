"""Soak run: a local dock under GRPO-like traffic, consumers killed now and then.

    .venv/bin/python scripts/soak.py --minutes 10

Starts `dockd.start_local(num_warehouses=2)`, then for --minutes runs producer
processes that put batches of GRPO-like samples (prompts, responses, log-probs,
rewards; groups of 8) into rotating partitions `soak-0`, `soak-1`, ..., and
consumer processes (two consumer names, several processes each) that take them
until each partition is drained. The driver seals a partition once every
producer is done with it and clears it once every consumer name has taken all
of it. Every --kill-every seconds a random consumer process is SIGKILLed and
started again. Each daemon's RSS and open descriptors are sampled every
--sample-every seconds.

At the end everything is cleared, the daemons get a few seconds to settle, and a
table gives each daemon's RSS and descriptors at the start (after a warm-up
partition), at their peak and at the end. Then delivery is checked per consumer
name: every sample of every cleared partition delivered exactly once, except
that a sample may be delivered again when an earlier delivery went to a process
that was SIGKILLed before it could confirm it (within --confirm-window seconds
of its death), and a get's worth of samples may be missing where a process was
SIGKILLed after its get confirmed them and before it wrote them down (both are
counted). Exits 1 if that check fails.

With --chaos it is instead the chaos test (tests/reliability/test_chaos.py) for
--minutes: a controller with a state dir and two warehouses with data dirs, one
producer and one consumer process, and every --min-gap..--max-gap seconds (at
random) a random one of them SIGKILLed and started again (a worker sometimes at
the riskiest moment: the producer with its put in flight, the consumer right
after a get returned, before its confirm went out). One line per kill; at the
end the producer stops, the consumer takes what is left, and the accounting is
printed: ids acknowledged, delivered, duplicates allowed (re-delivery of batches
whose confirm never reached the controller) and unexplained, lost. Exits 1 on a
violation or when the stream stalls for --stall seconds after a kill.

    .venv/bin/python scripts/soak.py --chaos --minutes 10

--commit-window S starts the warehouses with `--commit-window S` (puts answered
before their commit); with data dirs a killed warehouse loses none of them (its
files keep their commits, sent again when it restarts), so nothing may be lost.
With --no-data-dirs a killed warehouse loses what it held, as
docs/cluster.md says, and the accounting excuses exactly that: an acknowledged
id may be missing (or named by a DockDataLost) only when the warehouse that
answered its put (the producer's home, by id; a restarted one joins under a new
id) is not in the dock at the end; every other check stays as strict, and the
excused ids are counted per warehouse. --prefetch N has the consumer take
leases ahead (`get(prefetch=N)`); --kinds picks what is killed, e.g.
--kinds controller,producer,consumer to keep warehouses without data dirs
alive (then nothing may be lost).

    .venv/bin/python scripts/soak.py --chaos --minutes 3 --commit-window 0.05
    .venv/bin/python scripts/soak.py --chaos --minutes 3 --commit-window 0.05 --no-data-dirs

Not part of the test suite: it takes minutes and most of two cores.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time

GROUP = 8
NAMES = ("reference", "actor_train")
COLUMNS = {"reference": ["prompts", "responses"], "actor_train": ["prompts", "responses", "old_log_probs", "rewards"]}


# -- worker processes -------------------------------------------------------------------------------
def _producer(address: str, rank: int, args, done, cleared) -> None:
    """Put `--puts` batches into each partition in turn; done[rank] = the last partition finished."""
    import torch

    import dockd

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    with dockd.connect(address) as dock:
        k = 0
        while True:
            while k - cleared.value >= args.ahead:  # at most --ahead partitions in the dock
                time.sleep(0.05)
            for _ in range(args.puts):
                n = args.batch
                plen = torch.randint(64, 512, (n,), generator=gen).tolist()
                rlen = torch.randint(256, 2048, (n,), generator=gen).tolist()
                dock.put({
                    "prompts": [torch.randint(0, 32000, (p,), generator=gen) for p in plen],
                    "responses": [torch.randint(0, 32000, (r,), generator=gen) for r in rlen],
                    "old_log_probs": [-torch.rand(r, generator=gen) for r in rlen],
                    "rewards": torch.rand(n, generator=gen),
                }, partition=f"soak-{k}", group_size=GROUP, timeout=60)
                time.sleep(args.put_interval)
            done[rank] = k
            k += 1


def _consumer(address: str, name: str, log_path: str, args, cleared) -> None:
    """Take samples of each partition until it is drained, logging every delivery as it returns."""
    import torch

    import dockd

    torch.set_num_threads(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    groups = name == "actor_train"
    with dockd.connect(address) as dock:
        k = cleared.value
        while True:
            k = max(k, cleared.value)
            try:
                batch = dock.get(name, COLUMNS[name], args.get_count, partition=f"soak-{k}", timeout=2.0,
                                 groups=groups)
            except (dockd.DockDrained, dockd.DockNotFound):
                k += 1
                continue
            except dockd.DockTimeout:
                continue
            os.write(fd, f"{time.time():.3f} {k} {' '.join(map(str, batch.indexes))}\n".encode())
            del batch


# -- the driver ------------------------------------------------------------------------------------
def _sample(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open descriptors) of a process."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Consumers:
    """The consumer processes: which incarnation is which, which were killed and when."""

    def __init__(self, ctx, address, args, cleared, logdir) -> None:
        self.ctx, self.address, self.args, self.cleared, self.logdir = ctx, address, args, cleared, logdir
        self.slots: list[tuple[str, mp.Process, str]] = []
        self.killed: dict[str, float] = {}  # log path -> time of its SIGKILL
        self.incarnations = 0
        for i in range(args.consumers):
            self.slots.append(self._start(NAMES[i % len(NAMES)]))

    def _start(self, name: str):
        self.incarnations += 1
        path = os.path.join(self.logdir, f"{name}.{self.incarnations}.log")
        p = self.ctx.Process(target=_consumer, args=(self.address, name, path, self.args, self.cleared), daemon=True)
        p.start()
        return name, p, path

    def kill_one(self) -> str:
        i = random.randrange(len(self.slots))
        name, p, path = self.slots[i]
        os.kill(p.pid, signal.SIGKILL)
        self.killed[path] = time.time()
        p.join()
        self.slots[i] = self._start(name)
        return name

    def stop(self) -> None:
        for _, p, _ in self.slots:
            p.terminate()
        for _, p, _ in self.slots:
            p.join(10)


def check_delivery(logdir: str, killed: dict[str, float], sizes: dict[int, int], window: float,
                   get_count: int) -> list[str]:
    """Problems with delivery per consumer name over the cleared partitions (empty: exactly once)."""
    seen: dict[tuple[str, int], dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    # per (name, partition): gets a killed process may have confirmed and not written down yet (its last
    # partition; -1: it wrote nothing)
    lost_gets: collections.Counter = collections.Counter()
    for fn in os.listdir(logdir):
        path = os.path.join(logdir, fn)
        name = fn.split(".")[0]
        died = killed.get(path)
        last = -1
        with open(path) as f:
            for line in f:
                t, k, *idx = line.split()
                last = int(k)
                # a delivery the killed process may not have confirmed
                unconfirmed = died is not None and float(t) >= died - window
                for i in idx:
                    seen[(name, int(k))][int(i)].append(unconfirmed)
        if died is not None:
            lost_gets[(name, last)] += 1
    problems = []
    redelivered = unlogged = 0
    for k, size in sorted(sizes.items()):
        for name in NAMES:
            got = seen.get((name, k), {})
            missing = size - sum(1 for i in got if 0 <= i < size)
            # a get a process confirmed just before it was killed, before it wrote the samples down
            excused = get_count * (lost_gets[(name, k)] + lost_gets[(name, -1)])
            if missing and missing <= excused:
                unlogged += missing
            elif missing or any(i >= size for i in got):
                problems.append(f"{name} soak-{k}: {missing} of {size} samples never delivered")
            for i, deliveries in got.items():
                extra = len(deliveries) - 1
                if extra > 0:
                    if sum(deliveries) < extra:
                        problems.append(f"{name} soak-{k}: sample {i} delivered {len(deliveries)} times")
                    redelivered += 1
    print(f"delivery: {sum(sizes.values())} samples in {len(sizes)} partitions x {len(NAMES)} consumers; "
          f"{redelivered} re-delivered after a consumer was killed holding them; {unlogged} taken by a consumer "
          f"killed before it wrote them down; "
          f"{len(problems)} problems", flush=True)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warehouses", type=int, default=2)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=4, help="processes, alternating between the two consumer names")
    ap.add_argument("--puts", type=int, default=4, help="puts per producer per partition")
    ap.add_argument("--batch", type=int, default=32, help="samples per put (a multiple of 8)")
    ap.add_argument("--get-count", type=int, default=16, help="samples per get (a multiple of 8)")
    ap.add_argument("--put-interval", type=float, default=0.02, help="seconds a producer sleeps after each put")
    ap.add_argument("--ahead", type=int, default=3, help="partitions in the dock at most")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between consumer SIGKILLs (0: none)")
    ap.add_argument("--sample-every", type=float, default=3.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after the final clear before the last sample")
    ap.add_argument("--confirm-window", type=float, default=2.0,
                    help="a killed consumer's deliveries this close to its death may be re-delivered")
    ap.add_argument("--csv", help="write every sample (time, pid, rss_kib, fds) to this file")
    ap.add_argument("--chaos", action="store_true",
                    help="instead: random SIGKILLs of the controller, warehouses, producer and consumer (see above)")
    ap.add_argument("--min-gap", type=float, default=3.0, help="--chaos: seconds between kills, at least")
    ap.add_argument("--max-gap", type=float, default=15.0, help="--chaos: seconds between kills, at most")
    ap.add_argument("--stall", type=float, default=60.0,
                    help="--chaos: seconds without delivery after a kill that count as a hang")
    ap.add_argument("--seed", type=int, default=None, help="--chaos: seed of the kill schedule (default: random)")
    ap.add_argument("--kinds", default="controller,warehouse,producer,consumer",
                    help="--chaos: what is killed (comma-separated)")
    ap.add_argument("--commit-window", type=float, default=0.0,
                    help="--chaos: warehouses answer puts before their commit, sent every this many seconds")
    ap.add_argument("--no-data-dirs", action="store_true",
                    help="--chaos: warehouses without data dirs (a killed one loses what it held: excused, counted)")
    ap.add_argument("--prefetch", type=int, default=0, help="--chaos: the consumer's gets take leases ahead (> 1)")
    args = ap.parse_args(argv)
    bad = set(args.kinds.split(",")) - {"controller", "warehouse", "producer", "consumer"}
    if bad:
        ap.error(f"--kinds takes controller, warehouse, producer, consumer; not {sorted(bad)}")
    if args.prefetch == 1 or args.prefetch < 0:
        ap.error(f"--prefetch takes leases ahead when > 1 (0: none), got {args.prefetch}")
    if args.chaos:
        if args.seed is None:
            args.seed = random.randrange(1 << 30)
        from soak_chaos import chaos  # (this script's folder is on the path)

        return chaos(args)

    import dockd

    ctx = mp.get_context("spawn")
    cleared = ctx.Value("i", 0, lock=False)  # partitions below this one are cleared
    done = ctx.Array("i", [-1] * args.producers, lock=False)  # per producer: the last partition it finished
    logdir = tempfile.mkdtemp(prefix="dockd-soak-")
    cluster = dockd.start_local(num_warehouses=args.warehouses)
    pids = [p.pid for p in cluster.procs]
    roles = ["controller+wh0"] + [f"wh{i}" for i in range(1, len(pids))]
    samples: list[tuple[float, int, int, int]] = []
    producers: list = []
    consumers = None
    sizes: dict[int, int] = {}  # cleared partition -> samples
    kills = 0
    rc = 0
    try:
        dock = dockd.connect(cluster.address)
        start = {pid: _sample(pid) for pid in pids}
        producers = [ctx.Process(target=_producer, args=(cluster.address, r, args, done, cleared), daemon=True)
                     for r in range(args.producers)]
        for p in producers:
            p.start()
        consumers = Consumers(ctx, cluster.address, args, cleared, logdir)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_kill = t0 + args.kill_every if args.kill_every > 0 else float("inf")
        next_sample = next_status = t0
        sealed = set()
        baseline_at = None
        while time.monotonic() < end:
            now = time.monotonic()
            stats = dock.stats()["partitions"]
            k = cleared.value
            finished = min(done)
            for j in range(k, finished + 1):
                if j not in sealed and f"soak-{j}" in stats:
                    dock.seal(f"soak-{j}")
                    sealed.add(j)
            part = stats.get(f"soak-{k}")
            if k in sealed and part is not None and all(
                    part["consumers"].get(n, {}).get("taken", 0) == part["samples"] for n in NAMES):
                sizes[k] = part["samples"]
                dock.clear(f"soak-{k}")
                cleared.value = k + 1
                if baseline_at is None:  # the first partition through: the daemons are warm
                    start = {pid: _sample(pid) for pid in pids}
                    baseline_at = now
            if now >= next_kill:
                consumers.kill_one()
                kills += 1
                next_kill += args.kill_every
            if now >= next_sample:
                for pid in pids:
                    samples.append((time.time(), pid, *_sample(pid)))
                next_sample += args.sample_every
            if now >= next_status:
                last = {pid: (r, f) for _, pid, r, f in samples[-len(pids):]}
                mem = "  ".join(f"{role} {last[pid][0] / 1024:.0f} MiB {last[pid][1]} fds" for role, pid in zip(roles, pids))
                print(f"[{now - t0:5.0f}s / {args.minutes * 60:.0f}s] partitions cleared {cleared.value}, "
                      f"kills {kills}  {mem}", flush=True)
                next_status += 15
            time.sleep(0.2)
        # stop the workers, then clear whatever is left
        for p in producers:
            p.terminate()
        consumers.stop()
        for p in producers:
            p.join(10)
        for name in dock.stats()["partitions"]:
            dock.clear(name)
        dock.close()
        time.sleep(args.settle)
        final = {pid: _sample(pid) for pid in pids}
        for pid in pids:
            samples.append((time.time(), pid, *final[pid]))
        print(f"\n{args.minutes:g} min, {args.producers} producers, {args.consumers} consumers, {kills} consumer "
              f"SIGKILLs, {cleared.value} partitions cleared")
        print(f"{'daemon':16}{'pid':>8}  {'RSS MiB: start':>14}{'peak':>8}{'end':>8}   {'fds: start':>10}{'peak':>6}{'end':>6}")
        for role, pid in zip(roles, pids):
            mine = [(r, f) for _, p, r, f in samples if p == pid]
            print(f"{role:16}{pid:>8}  {start[pid][0] / 1024:>14.0f}{max(r for r, _ in mine) / 1024:>8.0f}"
                  f"{final[pid][0] / 1024:>8.0f}   {start[pid][1]:>10}{max(f for _, f in mine):>6}{final[pid][1]:>6}")
        if args.csv:
            with open(args.csv, "w") as f:
                f.write("time,pid,rss_kib,fds\n")
                f.writelines(f"{t:.1f},{p},{r},{n}\n" for t, p, r, n in samples)
        problems = check_delivery(logdir, consumers.killed, sizes, args.confirm_window, args.get_count)
        for line in problems[:20]:
            print("  " + line)
        rc = 1 if problems else 0
    finally:
        for p in producers:
            if p.is_alive():
                p.kill()
        if consumers is not None:
            for _, p, _ in consumers.slots:
                if p.is_alive():
                    p.kill()
        cluster.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
