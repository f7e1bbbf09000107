"""Stage-3 step time of a model of tiny ops, to compare the zeropp on ``PYTHONPATH`` against another commit.

The interception that finds external reads (Note [external reads]) costs a Python call per torch call;
its cost shows most on many small ops. Run this once per checkout, alternating, and compare medians:

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/bench_watch_cost.py
    .venv/bin/python bench/bench_watch_cost.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

CFG = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "gather_granularity": "module"}}


def worker(rank: int, world: int, steps: int) -> tuple[float, str]:
    import zeropp
    from zeropp.tools.demo.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=6, n_embd=64, n_head=4, vocab_size=512))
    engine = zeropp.initialize(model=model, config=CFG)[0]
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x = torch.randint(0, 512, (4, 64), generator=g)
        start = time.perf_counter()
        engine.backward(engine(x, torch.roll(x, 1, 1)))
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), zeropp.__file__


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from support.world import run_world
    median, source = run_world(worker, 1, 60)[0]
    print(f"median step {median * 1e3:.1f} ms  (zeropp from {source})")
