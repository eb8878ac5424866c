"""A real GRPO run on CPU: a tiny megatron-core GPT, TP=2 over gloo, two processes, dockd in between.

    python examples/grpo_tiny.py                 # 50 steps; see docs/plugins.md for measured times
    python examples/grpo_tiny.py --steps 60 --plot /tmp/curve.png --json /tmp/curve.json

The toy task has a verifiable reward: the prompt is four random digits and the
model must answer with the first of them, repeated; the reward of a response is
the fraction of its tokens equal to that digit (a random policy scores about
1/16). Every stage (rollout, reward, reference log-prob, old log-prob,
advantage, update) reads its inputs from the dock and writes its outputs back,
in MindSpeed-RL's column/consumer layout. The mean reward per step is printed
(and plotted into results/grpo_tiny.png, a gitignored folder of the checkout,
when matplotlib is installed: pip install -e '.[plot]'); it should climb from
~0.06 towards 1.

Each step also prints the policy's KL to the frozen reference (the k3
estimator, mean per response token): how far training has moved the policy.
The PPO-clip loss is not printed: with one update epoch per step the update
runs on the very policy that sampled the step (ratio = 1) and GRPO's advantages
are normalised to mean 0 within each group, so the loss's value is 0 up to
rounding at every step (median |loss| 2e-8 over a default run, at most 5e-4)
although its gradient is not. It is still written to the --json file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dockd

VOCAB = 16
DIGITS = 10
PROMPT_LEN = 4
#: where the reward curve goes by default: results/ of the checkout (gitignored)
DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "results" / "grpo_tiny.png"


def quiet_megatron_warnings() -> None:
    """Hide megatron-core's notices about optional CUDA extras that a CPU run never uses."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # "Transformer Engine and Apex are not installed. Falling back to ..." (printed per module, per rank)
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed")
    warnings.filterwarnings("ignore", message=r"When using async grad allreduce it is recommended to set the "
                                              r"environment variable CUDA_DEVICE_MAX_CONNECTIONS")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated", module=r"megatron\.")


def reward_fn(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Fraction of response tokens equal to the prompt's first digit (verifiable, in [0, 1])."""
    return (responses == prompts[:, :1]).float().mean(dim=1)


def prompt_fn(step: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, DIGITS, (count, PROMPT_LEN), generator=g)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, address: str, args: dict[str, Any], out_path: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(name)s %(message)s")
    quiet_megatron_warnings()

    from dockd.trainer_plugins.megatron_grpo import (
        GRPOConfig,
        GRPOPipeline,
        build_tiny_gpt,
        collective_backend,
        init_model_parallel,
    )

    device = torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(collective_backend(device), rank=rank, world_size=world)
    try:
        init_model_parallel(tensor_parallel_size=world, seed=args["seed"], device=device)
        shape = dict(vocab_size=VOCAB, max_sequence_length=32, hidden_size=64, num_layers=2, num_attention_heads=4)
        actor = build_tiny_gpt(**shape)
        reference = build_tiny_gpt(**shape)  # megatron modules hold process groups: no deepcopy
        reference.load_state_dict(actor.state_dict())
        config = GRPOConfig(
            prompts_per_step=args["prompts"],
            group_size=args["group_size"],
            max_response_length=args["response_length"],
            lr=args["lr"],
            kl_coef=args["kl_coef"],
            tp_fetch=args["tp_fetch"],
            seed=args["seed"],
        )
        optimizer = torch.optim.Adam(actor.parameters(), lr=config.lr)
        pipe = GRPOPipeline(
            dock_address=address,
            actor=actor,
            reference=reference,
            optimizer=optimizer,
            reward_fn=reward_fn,
            prompt_fn=prompt_fn,
            config=config,
            device=device,
        )

        hook = _step_hook(args.get("step_hook"))

        def report(m: Any) -> None:
            if hook is not None:  # (e.g. benchmarks/weights/delta_grpo.py: each rank's weights after the step)
                hook(rank, m.step, actor, address)
            if rank == 0:
                bar = "#" * int(round(m.reward_mean * 40))
                print(
                    f"step {m.step:3d}  reward {m.reward_mean:.3f}  {bar:<40s}  kl {m.kl:.4f}  {m.seconds:.2f}s",
                    flush=True,
                )

        history = pipe.run(args["steps"], on_step=report)
        pipe.close()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(
                    {
                        "reward": [m.reward_mean for m in history],
                        "kl": [m.kl for m in history],
                        "loss": [m.loss for m in history],
                        "seconds": [m.seconds for m in history],
                        "stage_seconds": [m.stage_seconds for m in history],
                        "config": args,
                    },
                    f,
                )
        dist.barrier()  # nobody tears down while a peer still has collectives in flight
    finally:
        dist.destroy_process_group()


def _step_hook(spec: str | None) -> Any:
    """`module:function` called as function(rank, step, actor, dock_address) after every step (None: none)."""
    if not spec:
        return None
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def save_plot(rewards: list[float], path: str) -> bool:
    """Draw the reward curve into `path`; False (nothing drawn) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rewards)), rewards, marker=".", label="mean reward")
    k = 5
    if len(rewards) >= k:
        smooth = [sum(rewards[i - k + 1 : i + 1]) / k for i in range(k - 1, len(rewards))]
        ax.plot(range(k - 1, len(rewards)), smooth, label=f"{k}-step mean")
    ax.axhline(1 / VOCAB, color="gray", linestyle=":", label="random policy")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.set_title("grpo_tiny: megatron-core GPT, TP=2 (gloo), samples via dockd")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(
    *,
    steps: int = 50,
    prompts: int = 64,
    group_size: int = 8,
    response_length: int = 6,
    lr: float = 5e-3,
    kl_coef: float = 0.0,
    tp_fetch: str = "group",
    seed: int = 1234,
    json_path: str | None = None,
    address: str | None = None,
    step_hook: str | None = None,
) -> dict[str, Any]:
    """Run the example (2 processes) and return {"reward": [...], "seconds": [...], ...}. `step_hook`:
    "module:function" each rank calls after every step with (rank, step, actor, dock address)."""
    import tempfile

    args = dict(
        steps=steps,
        prompts=prompts,
        group_size=group_size,
        response_length=response_length,
        lr=lr,
        kl_coef=kl_coef,
        tp_fetch=tp_fetch,
        seed=seed,
        step_hook=step_hook,
    )
    out_path = json_path or os.path.join(tempfile.mkdtemp(prefix="grpo_tiny-"), "curve.json")
    port = _free_port()

    def launch(addr: str) -> None:
        mp.start_processes(_worker, args=(2, port, addr, args, out_path), nprocs=2, join=True, start_method="spawn")

    if address is None:
        with dockd.start_local(num_warehouses=2) as cluster:
            launch(cluster.address)
    else:
        launch(address)
    with open(out_path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    p.add_argument("--response-length", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--tp-fetch", choices=["broadcast", "shared", "group"], default="group")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--address", default=None, help="use a running dock instead of starting a local one")
    p.add_argument("--plot", default=str(DEFAULT_PLOT),
                   help=f"where to save the reward curve (PNG; default {DEFAULT_PLOT}; '' for none)")
    p.add_argument("--json", default=None, help="also write the curve as JSON here")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    result = run(
        steps=a.steps,
        prompts=a.prompts,
        group_size=a.group_size,
        response_length=a.response_length,
        lr=a.lr,
        kl_coef=a.kl_coef,
        tp_fetch=a.tp_fetch,
        seed=a.seed,
        json_path=a.json,
        address=a.address,
    )
    rewards = result["reward"]
    k = min(10, len(rewards) // 2) or 1
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}  ({time.perf_counter() - t0:.0f}s)")
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        if save_plot(rewards, a.plot):
            print(f"reward curve saved to {a.plot}")
        else:
            print("no plot: matplotlib is not installed (pip install -e '.[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
