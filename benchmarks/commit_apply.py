"""What applying a warehouse's batch of commits costs the controller, per commit, in process.

    python -m benchmarks.commit_apply [--commits 20000] [--batch 1,2,4,8,64] [--rounds 3] [--no-state-dir] [--writes]

A `ControllerService` with a state dir (its journal written as a daemon's is), one registered warehouse,
and N commits of one trajectory each (two columns, a writer token, a put id) fed as `CommitBatch`es of B
(B = 1: `commit`, as a warehouse sends a lone commit). `--writes`: N samples are put first, then the N
commits each write a column of one of them (`indexes=`: a reward written after its trajectory). No socket, no parse of the wire: the CPU of the
service's own work per commit, the part that applying consecutive commits as runs
(`dockd/controller/commit_runs.py`) changes. Each batch size gets a fresh service per round; the best
round is kept (a shared VM's figures are noisy). Run it from two checkouts (PYTHONPATH) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time


def per_commit_us(n: int, batch: int, state_dir: bool, writes: bool = False) -> float:
    """CPU microseconds per commit for `n` commits fed `batch` at a time."""
    from dockd._proto import dockd_pb2 as pb
    from dockd.controller.core import Controller
    from dockd.controller.service import ControllerService
    from dockd.net import auth
    from dockd.net.peer import Peer

    class _Link(Peer):  # (the warehouse's connection as the service sees it: never connected)
        def __init__(self) -> None:
            super().__init__(None, max_body=0)
            self.name, self.session, self.role = "warehouse", b"", auth.DAEMON

        def reply(self, frame, out, *rest, tail: bytes = b"") -> None:
            pass

        def reply_error(self, frame, exc) -> None:
            pass

    async def main() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            svc = ControllerService(Controller(lease_timeout=30.0), state_dir=tmp if state_dir else None)
            svc.start()
            wid = svc.register(_Link(), pb.RegisterWarehouse(host="10.0.0.9", port=7000, capacity=1 << 30,
                                                             instance=77)).id
            if writes:
                svc.commit(pb.CommitRequest(partition="p", columns=["tokens"], new_count=n, warehouse=wid, put_id=n + 1))
                reqs = [pb.CommitRequest(partition="p", columns=["reward"], indexes=[i], warehouse=wid, nbytes=8,
                                         put_id=i + 1, token=(i + 1) * 7919) for i in range(n)]
            else:
                reqs = [pb.CommitRequest(partition="p", columns=["tokens", "reward"], new_count=1, warehouse=wid,
                                         nbytes=1100, put_id=i + 1, token=(i + 1) * 7919, has_timeout=True,
                                         timeout=30.0) for i in range(n)]
            batches = [pb.CommitBatch(commits=reqs[i:i + batch]) for i in range(0, n, batch)]
            t = time.process_time()
            for b in batches:
                if batch == 1:
                    svc.commit(b.commits[0])
                else:
                    svc.commit_batch(b)
            dt = time.process_time() - t
            part = svc.core.partitions["p"]
            assert part.size == n and bool((part.ready[:n] == part.ready[0]).all())  # (every commit applied)
            svc.shutdown()
            return dt / n * 1e6

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.commit_apply")
    p.add_argument("--commits", type=int, default=20000)
    p.add_argument("--batch", default="1,2,4,8,64", help="commits per batch, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-state-dir", action="store_true", help="no journal (a controller without --state-dir)")
    p.add_argument("--writes", action="store_true", help="commits of a column of existing samples (indexes=)")
    args = p.parse_args(argv)
    import dockd

    sizes = [int(x) for x in args.batch.split(",")]
    print(f"dockd from {dockd.__file__}; {args.commits} commits of {'a column of one existing sample' if args.writes else 'one new sample'}; "
          f"state dir: {not args.no_state_dir}")
    print("| commits per batch | CPU us per commit (best of rounds) | rounds |\n|---|---|---|")
    for b in sizes:
        got = [per_commit_us(args.commits, b, not args.no_state_dir, args.writes) for _ in range(args.rounds)]
        print(f"| {b} | {min(got):.1f} | {', '.join(f'{x:.1f}' for x in got)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
