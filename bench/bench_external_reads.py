"""Stage 3 on a model that reads a child's weight in the parent's forward, against the same model written
for the engine (issue 12's "after the first step no slower than a model without the pattern").

Two GPTs with the same weights: ``tied`` shares one parameter between the embedding and an ``lm_head``
Linear (the engine sees both holders and gathers it once, at their common ancestor); ``parent_reads``
has no head module and computes ``x @ wte.weight.t()`` in its own forward, which the engine only finds
while it runs (Note [external reads]). Both train in bf16 under ZeRO-3 on 2 gloo ranks; steps alternate
between the two so both see the same machine load. Reported: median step time of each after the first
step, their ratio, and the bytes of the last step (equal if the learned span removes the extra gather).

    .venv/bin/python bench/bench_external_reads.py [--steps 30] [--out bench/results/external_reads.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import RESULTS, write_results  # noqa: E402

CFG = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}


def _models():  # noqa: ANN202
    from zeropp.tools.demo.model import GPT, GPTConfig

    class ParentReads(GPT):
        """The head is the embedding's weight, read by the parent's forward after wte's forward ended."""

        def __init__(self, cfg: GPTConfig) -> None:
            super().__init__(cfg)
            del self.lm_head

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1])
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            logits = self.transformer.ln_f(x) @ self.transformer.wte.weight.t()
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    cfg = GPTConfig(block_size=128, n_layer=4, n_embd=256, n_head=4, vocab_size=8192)
    return {"tied": lambda: GPT(cfg), "parent_reads": lambda: ParentReads(GPTConfig(**{**cfg.__dict__,
                                                                                    "tie_weights": False}))}


def worker(rank: int, world: int, steps: int) -> dict:
    import zeropp
    engines = {}
    for name, make in _models().items():
        torch.manual_seed(0)
        engines[name] = zeropp.initialize(model=make(), config=CFG)[0]
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {n: [] for n in engines}
    for step in range(steps):
        x = torch.randint(0, 8192, (4, 128), generator=g)
        for name, engine in engines.items():
            start = time.perf_counter()
            loss = engine(x, torch.roll(x, 1, 1))
            engine.backward(loss)
            engine.step()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, engine in engines.items():
        rep = engine.comm_report()
        out[name] = {"median_step_s": statistics.median(times[name][1:]), "first_step_s": times[name][0],
                     "bytes": {ph: v["intra_node_bytes"] + v["inter_node_bytes"] for ph, v in rep.items()}}
    out["ratio_parent_reads_over_tied"] = out["parent_reads"]["median_step_s"] / out["tied"]["median_step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(RESULTS, "external_reads.json"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from support.world import run_world
    res = run_world(worker, 2, args.steps)[0]
    for name in ("tied", "parent_reads"):
        r = res[name]
        print(f"{name:13s} median step {r['median_step_s'] * 1e3:7.1f} ms (first {r['first_step_s'] * 1e3:.0f} ms)"
              f"  bytes {r['bytes']}")
    print(f"parent_reads / tied step time: {res['ratio_parent_reads_over_tied']:.3f}")
    res["command"] = "python bench/bench_external_reads.py " + " ".join(sys.argv[1:])
    write_results(args.out, res)


if __name__ == "__main__":
    main()
