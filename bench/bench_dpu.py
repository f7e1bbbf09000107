"""Step time with and without the delayed parameter update (ZeRO-Offload's DPU), same run, alternating.

    python bench/bench_dpu.py [--world 2] [--steps 12] [--rounds 2]

Each rank trains the demo GPT (stage 2, bf16, optimizer offloaded to the host, CpuAdam) for ``--steps``
optimizer steps with DPU off, then on, ``--rounds`` times over; the median step time after the warm-up steps
is reported per mode, and the ratio. DPU overlaps the host optimizer step with the next forward/backward, so
it gains most when the step is a large part of the iteration (big models, few tokens per step).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.world import run_world  # noqa: E402
from results_io import RESULTS, write_results  # noqa: E402

WARMUP = 3


def worker(rank: int, world: int, steps: int, rounds: int, n_embd: int) -> dict:
    import zeropp
    from zeropp.tools.demo.data import corpus_tokens, get_batch
    from zeropp.tools.demo.model import GPT, GPTConfig

    tokens = corpus_tokens()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {
                       "device": "cpu", "delayed_update": mode == "on", "delayed_update_warmup_steps": WARMUP}}}
            torch.manual_seed(0)
            engine, *_ = zeropp.initialize(model=GPT(GPTConfig(block_size=32, n_layer=4, n_embd=n_embd)), config=cfg)
            for step in range(steps):
                x, y = get_batch(tokens, step, world, 32, seed=0, rank=rank, world_size=world)
                t0 = time.perf_counter()
                engine.backward(engine(x, y))
                engine.step()
                if step >= WARMUP + 1:  # the first delayed step has nothing to wait for
                    times[mode].append(time.perf_counter() - t0)
            engine.join_update()
    params = sum(p.numel() for p in engine.module.parameters())
    return {"median_off": statistics.median(times["off"]), "median_on": statistics.median(times["on"]),
            "parameters": params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=512)
    args = p.parse_args()
    res = run_world(worker, args.world, args.steps, args.rounds, args.n_embd)[0]
    res["ratio_on_over_off"] = res["median_on"] / res["median_off"]
    write_results(os.path.join(RESULTS, "dpu.json"), vars(args) | res)
    print("| parameters | ranks | step time, DPU off | step time, DPU on | ratio |")
    print("|---|---|---|---|---|")
    print(f"| {res['parameters']:,} | {args.world} | {res['median_off'] * 1e3:.0f} ms | "
          f"{res['median_on'] * 1e3:.0f} ms | {res['ratio_on_over_off']:.2f}x |")


if __name__ == "__main__":
    main()
