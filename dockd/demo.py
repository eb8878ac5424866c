"""`dockd demo`: a synthetic GRPO iteration loop through a local dock.

A driver writes prompts in groups; five stage processes (rollout, reward,
reference, advantage, train) each take what they need from the dock as it
becomes ready and write their outputs back, exactly as the workers of an RL
pipeline would. The train stage clears each step's partition when it is done.
Two steps are in flight at once, so rollout of step k+1 overlaps training of
step k. Prints a table of what each stage moved.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time

import torch

_STAGES = {
    # name: (consumer, columns read, groups)
    "rollout": ("actor_rollout", ["prompts"], False),
    "reward": ("reward", ["prompts", "responses"], False),
    "reference": ("reference", ["prompts", "responses"], False),
    "advantage": ("advantage", ["responses", "rewards"], True),
    "train": ("actor_train", ["prompts", "responses", "ref_log_prob", "advantages"], True),
}


@dataclasses.dataclass
class StageReport:
    stage: str
    samples: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    io_seconds: float = 0.0
    wall_seconds: float = 0.0


def _nbytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _work(stage: str, batch, gen: torch.Generator, group_size: int) -> dict:
    if stage == "rollout":
        lens = torch.randint(64, 512, (len(batch),), generator=gen)
        return {"responses": [torch.randint(0, 32000, (int(n),), generator=gen) for n in lens]}
    if stage == "reward":
        # verifiable toy reward: fraction of even tokens in the response
        return {"rewards": [((r % 2) == 0).float().mean() for r in batch["responses"]]}
    if stage == "reference":
        return {"ref_log_prob": [-torch.rand(len(r), generator=gen) for r in batch["responses"]]}
    if stage == "advantage":
        rewards = torch.stack(batch["rewards"]).view(-1, group_size)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        return {"advantages": [torch.full((len(r),), float(a)) for r, a in zip(batch["responses"], adv)]}
    # train: a stand-in for the policy-gradient loss
    loss = sum(float((a * lp).sum()) for a, lp in zip(batch["advantages"], batch["ref_log_prob"]))
    assert loss == loss
    return {}


def _stage_main(stage: str, address: str, steps: int, total: int, chunk: int, group_size: int, events) -> None:
    import dockd

    torch.set_num_threads(1)
    consumer, columns, groups = _STAGES[stage]
    rep = StageReport(stage)
    gen = torch.Generator().manual_seed(hash(stage) % 2**31)
    with dockd.connect(address) as dock:
        start = None
        for step in range(steps):
            part = f"step-{step}"
            done = 0
            while done < total:
                t0 = time.perf_counter()
                batch = dock.get(consumer, columns, min(chunk, total - done), partition=part, groups=groups, timeout=120)
                rep.io_seconds += time.perf_counter() - t0
                start = start or t0
                rep.bytes_in += sum(_nbytes(batch[c]) for c in columns)
                out = _work(stage, batch, gen, group_size)
                if out:
                    t0 = time.perf_counter()
                    dock.put(out, partition=part, indexes=batch.indexes)
                    rep.io_seconds += time.perf_counter() - t0
                    rep.bytes_out += sum(_nbytes(v) for v in out.values())
                done += len(batch)
                rep.samples += len(batch)
            if stage == "train":
                dock.clear(part)
                events.put(("step", step))
        rep.wall_seconds = time.perf_counter() - (start or time.perf_counter())
    events.put(("report", dataclasses.asdict(rep)))


def run_demo(*, steps: int = 12, prompts: int = 32, group_size: int = 8, warehouses: int = 2, chunk: int = 64,
             lookahead: int = 2, quiet: bool = False) -> list[StageReport]:
    from tqdm import tqdm

    import dockd

    total = prompts * group_size
    chunk = max(group_size, chunk - chunk % group_size)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    t_start = time.perf_counter()
    with dockd.start_local(num_warehouses=warehouses) as cluster, dockd.connect(cluster.address) as dock:
        procs = [
            ctx.Process(target=_stage_main, args=(s, cluster.address, steps, total, chunk, group_size, events), name=s, daemon=True)
            for s in _STAGES
        ]
        for p in procs:
            p.start()
        gen = torch.Generator().manual_seed(0)
        bar = tqdm(total=steps, desc="GRPO steps", unit="step", disable=quiet)
        put_steps = 0
        finished = 0
        reports: list[StageReport] = []
        while put_steps < min(steps, lookahead):
            _put_prompts(dock, put_steps, prompts, group_size, gen)
            put_steps += 1
        while len(reports) < len(procs):
            try:
                kind, payload = events.get(timeout=5)
            except Exception:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"demo stage(s) {dead} crashed; see the traceback above") from None
                continue
            if kind == "step":
                finished += 1
                bar.update(1)
                if put_steps < steps:
                    _put_prompts(dock, put_steps, prompts, group_size, gen)
                    put_steps += 1
            else:
                reports.append(StageReport(**payload))
        bar.close()
        for p in procs:
            p.join()
    wall = time.perf_counter() - t_start
    if not quiet:
        print(format_table(reports, steps=steps, total=total, warehouses=warehouses, wall=wall))
    return reports


def _put_prompts(dock, step: int, prompts: int, group_size: int, gen: torch.Generator) -> None:
    batch = []
    for _ in range(prompts):
        p = torch.randint(0, 32000, (int(torch.randint(32, 256, (1,), generator=gen)),), generator=gen)
        batch += [p] * group_size
    dock.put({"prompts": batch}, partition=f"step-{step}", group_size=group_size)


def format_table(reports: list[StageReport], *, steps: int, total: int, warehouses: int, wall: float) -> str:
    order = {s: i for i, s in enumerate(_STAGES)}
    rows = [f"{'stage':<10} {'samples':>8} {'MB in':>8} {'MB out':>8} {'in dock s':>9} {'samples/s':>10} {'GB/s':>7}"]
    for r in sorted(reports, key=lambda r: order[r.stage]):
        moved = r.bytes_in + r.bytes_out
        rows.append(
            f"{r.stage:<10} {r.samples:>8} {r.bytes_in / 1e6:>8.1f} {r.bytes_out / 1e6:>8.1f} {r.io_seconds:>9.2f} "
            f"{r.samples / max(r.wall_seconds, 1e-9):>10.0f} {moved / max(r.wall_seconds, 1e-9) / 1e9:>7.3f}"
        )
    rows.append(
        f"{steps} steps x {total} samples through {warehouses} warehouses in {wall:.1f}s "
        f"({steps * total / wall:.0f} samples/s end to end, process start-up included).\n"
        "Per stage, samples/s and GB/s (in+out) span its first batch to its last; 'in dock s' is the time "
        "inside get/put, waiting for upstream stages included."
    )
    return "\n".join(rows)
