"""Host bytes per parameter of ZeRO-Offload (``offload_optimizer: cpu``): resident set after the steps and its
peak, over a transformers Llama's parameter count, for each ``sub_group_size`` given; and the host step's time
and the fresh memory it pages in (minor faults) per step, after two steps.

    python bench/bench_offload_host.py [--sub-group-sizes 1000000000,20000000] [--layers 16] [--hidden 1024]
                                       [--timed-steps 3] [--delayed-update]

One process per setting (world 1, gloo, bf16, AdamW on the host). On this machine the model's 16-bit weights
are host memory too (2 bytes per parameter a GPU would hold); on a GPU the host holds the rest: the fp32
master (4), Adam's moments (8), the 16-bit gradient row (2) and the 16-bit upload row (2).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil


def measure(args: argparse.Namespace, sub_group: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeropp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    proc = psutil.Process()
    base = proc.memory_info().rss
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                         num_hidden_layers=args.layers, num_attention_heads=16,
                                         num_key_value_heads=16, vocab_size=32000, use_cache=False))
    n = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
           "zero_optimization": {"stage": 3, "sub_group_size": sub_group,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": False,
                                                       "delayed_update": args.delayed_update,
                                                       "delayed_update_warmup_steps": 1}}}
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    del model
    x = torch.randint(0, 32000, (1, 128))
    step_s, faults = [], []
    for _ in range(2 + args.timed_steps):
        engine.backward(engine(input_ids=x, labels=x).loss)
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    steady = proc.memory_info().rss - base
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    timed = slice(2, None)  # the first two steps allocate the optimizer state
    return {"sub_group_size": sub_group, "params": n, "steady_bytes_per_param": steady / n,
            "peak_bytes_per_param": peak / n, "step_s": statistics.median(step_s[timed]),
            "fault_bytes_per_param_per_step": statistics.median(faults[timed]) * resource.getpagesize() / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sub-group-sizes", default="1000000000,20000000")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--timed-steps", type=int, default=3, help="steps timed after the first two")
    p.add_argument("--delayed-update", action="store_true",
                   help="the delayed parameter update (after one step without): its step call is timed")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "offload_host.json"))
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args, args.one)))
        return
    rows = []
    for size in map(int, args.sub_group_sizes.split(",")):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(size)], capture_output=True,
                             text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"sub_group_size {size:>13,}: {r['params'] / 1e6:.0f}M parameters, host bytes per parameter "
              f"{r['steady_bytes_per_param']:.1f} steady, {r['peak_bytes_per_param']:.1f} at the peak; optimizer step "
              f"{r['step_s']:.3f} s, fresh pages {r['fault_bytes_per_param_per_step']:.1f} B/parameter a step")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_results
    write_results(args.out, {"command": "python bench/bench_offload_host.py " + " ".join(sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
