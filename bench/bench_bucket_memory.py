"""Gradient buckets and reduce buffers on 2 simulated nodes x 2 ranks with ZeRO++, for the default config and
for DeepSpeed's ``reduce_bucket_size: 5e8`` written out: what ``memory_report()`` lists, against its bound, and
the reductions per backward.

Run from the repository root: ``.venv/bin/python bench/bench_bucket_memory.py``. The model is transformers'
GPT-2 small (124M parameters), built from a config, stage 3 with qwZ + hpZ + qgZ in bf16, one step of one
8-token sequence per rank (the buffers do not depend on the batch). ``--label`` names the run; run the script
with another zeropp on ``PYTHONPATH`` to measure that one side by side (the script reads only APIs both have).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from results_io import RESULTS, write_results  # noqa: E402
from support.world import run_world  # noqa: E402

CASES = {"default": None, "deepspeed_5e8": 500_000_000}


def worker(rank: int, world: int) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeropp
    from zeropp.comm.ledger import Link, Phase

    out = {}
    for name, bucket in CASES.items():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=64))
        zero = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                "zero_quantized_gradients": True}
        if bucket is not None:
            zero["reduce_bucket_size"] = bucket
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
        engine, *_ = zeropp.initialize(model=model, config=config)
        ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        report = engine.memory_report()
        out[name] = {"buffers": {k: (v["bytes"], v["bound"]) for k, v in report["buffers"].items()},
                     "buffer_bytes": report["buffer_bytes"], "buffer_bound": report["buffer_bound"],
                     "model_states": report["model_states"]["total"],
                     "reduce_bucket_size": getattr(engine, "reduce_bucket_size", bucket or 500_000_000),
                     "reductions": engine.ledger.last_step[(Phase.GRAD_REDUCE, Link.INTRA_NODE)].calls,
                     "parameters": sum(p.numel() for p in model.parameters())}
        engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="this")
    args = p.parse_args()
    ranks = run_world(worker, 4, ranks_per_node=2, timeout=1800)
    result = {"label": args.label, "ranks": {str(r): v for r, v in enumerate(ranks)}}
    for name in CASES:
        r = ranks[0][name]
        mib = {k: round(b / 2**20, 1) for k, (b, _) in r["buffers"].items()}
        print(f"{args.label} {name}: reduce_bucket_size {r['reduce_bucket_size']:,}, {r['reductions']} reductions, "
              f"buffers {r['buffer_bytes'] / 2**20:.1f} MiB (bound {r['buffer_bound'] / 2**20:.1f}) {mib}, "
              f"model states {r['model_states'] / 2**20:.1f} MiB")
    write_results(os.path.join(RESULTS, f"bucket_memory_{args.label}.json"), result)
    print(json.dumps({n: ranks[0][n]["buffer_bytes"] for n in CASES}))


if __name__ == "__main__":
    main()
