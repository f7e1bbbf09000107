"""Load a 1B+ Llama checkpoint into stage 3 on 4 ranks with ``zeropp.hf.from_pretrained``; each rank's peak
RSS against the formula.

The checkpoint is written first (random weights, bf16 safetensors, split in two files with an index, as
``save_pretrained`` shards large models): Llama, hidden 2048, MLP 5632, 18 layers, vocabulary 32000, 1.06B
parameters, 2.1 GB. Then 4 gloo ranks (2 simulated nodes x 2) each, from a bare process (torch, zeropp and
Dynamo imported, process group up):

1. ``from_pretrained(dir)``: formula = the rank's chunks (a quarter of the checkpoint, in its dtype) + the
   largest parameter's chunk in flight;
2. ``zeropp.initialize`` (stage 3, bf16): formula = the model states the engine reports
   (``model_state_bytes``: fp32 masters + bf16 shards) + the engine's buffers (``memory_report``) + one unit's
   full rows in the compute dtype (built and released per unit); the chunks of step 1 are freed as their
   units adopt them, so they are not in it.

Reported per rank: the peak rise of RSS over the bare process in each step (kernel VmHWM, reset before the
step), the formula, and their ratio.

    .venv/bin/python bench/bench_pretrained_load.py [--layers 18] [--dir DIR] [--out bench/results/pretrained_load.json]

``--transformers`` loads through transformers' own ZeRO-3 ``from_pretrained`` (an ``HfDeepSpeedConfig`` alive, the
DeepSpeed alias installed) instead; the bound per rank is its chunks + the largest parameter (gathered while rank
0 writes it) + on rank 0 the checkpoint (transformers 5 keeps every file it read mapped until the load ends).
Also reported: what the rank held before its first parameter was built (from_pretrained's own set-up), and the
rest of the peak against the bound.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from results_io import RESULTS, write_results  # noqa: E402

MiB = 2**20


def llama_config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                       tie_word_embeddings=False)


def write_checkpoint(path: str, layers: int) -> int:
    """Random bf16 weights in two safetensors files with an index; returns the parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM
    cfg = llama_config(layers)
    with torch.device("meta"):
        shapes = [(n, p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()]
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    halves = [shapes[: len(shapes) // 2], shapes[len(shapes) // 2:]]
    weight_map = {}
    for i, half in enumerate(halves):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: (torch.ones(s) if "norm" in n else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
                   for n, s in half}
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({n: name for n in tensors})
        del tensors
        gc.collect()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sum(s.numel() for _, s in shapes)


def worker(rank: int, world: int, path: str) -> dict:
    import torch
    import zeropp
    from support.rss import current_rss, peak_rss, reset_peak_rss
    from zeropp.hf import from_pretrained
    from zeropp.zero.construction import PARAMS
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # a bare training process has Dynamo imported
    gc.collect()
    bare = current_rss()
    reset = reset_peak_rss()
    start = time.perf_counter()
    model = from_pretrained(path)
    load_s = time.perf_counter() - start
    load_peak = peak_rss(reset) - bare
    records = [PARAMS.get(p) for p in model.parameters()]
    chunks = sum(r.shard.numel() * r.shard.element_size() for r in records)
    largest_chunk = max(r.shard.numel() * r.shard.element_size() for r in records)
    del records  # the table's records hold the chunks; initialize frees each as its unit adopts it
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7}}
    reset = reset_peak_rss()
    start = time.perf_counter()
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    init_s = time.perf_counter() - start
    init_peak = peak_rss(reset) - bare
    states = engine.model_state_bytes()["total"]
    unit = max(sum(s.spec.padded for s in u.slots) for u in engine.units) * 2  # one unit's full rows in bf16
    buffers = engine.memory_report()["buffer_bytes"]
    return {"rank": rank, "load_s": load_s, "load_peak": load_peak, "load_formula": chunks + largest_chunk,
            "chunks": chunks, "init_s": init_s, "init_peak": init_peak, "model_states": states,
            "init_formula": states + unit + buffers, "unit_bytes": unit, "buffers": buffers,
            "whole_model_bf16": sum(p.numel() for p in model.parameters()) * 2}


def transformers_worker(rank: int, world: int, path: str) -> dict:
    """transformers' own ZeRO-3 loading through the DeepSpeed alias: ``from_pretrained`` under an
    ``HfDeepSpeedConfig`` builds under ``deepspeed.zero.Init``; rank 0 reads the checkpoint and writes each module's
    parameters through ``GatheredParameters(modifier_rank=0)``."""
    import zeropp
    zeropp.install_deepspeed_alias()  # before transformers is imported (a fresh interpreter: see main)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from support.rss import current_rss, peak_rss, reset_peak_rss
    from zeropp.zero.construction import PARAMS, PartitionedParams
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    gc.collect()
    bare = current_rss()
    # the RSS when the first parameter is partitioned: what from_pretrained holds before any weight exists
    first: list[int] = []
    partition = PartitionedParams.partition

    def noted(self, *args, **kwargs):
        if not first:
            first.append(current_rss() - bare)
        return partition(self, *args, **kwargs)
    PartitionedParams.partition = noted
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},  # noqa: F841
                              "zero_optimization": {"stage": 3}})
    reset = reset_peak_rss()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    load_s = time.perf_counter() - start
    load_peak = peak_rss(reset) - bare
    records = [PARAMS.get(p) for p in model.parameters()]
    chunks = sum(r.shard.numel() * r.shard.element_size() for r in records)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    read = sum(os.path.getsize(f) for f in files) if rank == 0 else 0  # rank 0 reads the whole checkpoint
    PartitionedParams.partition = partition
    return {"rank": rank, "load_s": load_s, "load_peak": load_peak, "load_formula": chunks + largest + read,
            "chunks": chunks, "largest_param": largest, "checkpoint_read": read, "before_first_param": first[0],
            "partitioned": all(r is not None for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transformers", action="store_true",
                    help="load through transformers' ZeRO-3 from_pretrained (the DeepSpeed alias) instead")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="default bench/results/pretrained_load.json "
                                                "(pretrained_load_transformers.json with --transformers)")
    args = ap.parse_args()
    args.out = args.out or os.path.join(RESULTS, "pretrained_load_transformers.json" if args.transformers
                                        else "pretrained_load.json")
    from support.rss import MALLOC_ENV
    from support.world import run_world
    path = args.dir or tempfile.mkdtemp(prefix="zeropp-llama-")
    try:
        start = time.perf_counter()
        params = write_checkpoint(path, args.layers)
        print(f"checkpoint: {params / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f} s at {path}")
        # env given: spawned ranks, fresh interpreters (the alias must come before transformers is imported)
        ranks = run_world(transformers_worker if args.transformers else worker, 4, path, ranks_per_node=2,
                          env=MALLOC_ENV, timeout=1800)
    finally:
        if args.dir is None:
            shutil.rmtree(path, ignore_errors=True)
    if args.transformers:
        for r in ranks:
            print(f"rank {r['rank']}: transformers' ZeRO-3 from_pretrained {r['load_s']:.1f} s, peak "
                  f"{r['load_peak'] / MiB:.0f} MiB (bound: chunks {r['chunks'] / MiB:.0f} + largest parameter "
                  f"{r['largest_param'] / MiB:.0f} + checkpoint read {r['checkpoint_read'] / MiB:.0f} = "
                  f"{r['load_formula'] / MiB:.0f} MiB, {r['load_peak'] / r['load_formula']:.2f}x); held before the "
                  f"first parameter {r['before_first_param'] / MiB:.0f} MiB, the rest of the peak "
                  f"{(r['load_peak'] - r['before_first_param']) / r['load_formula']:.2f}x the bound")
        write_results(args.out, {"parameters": params, "layers": args.layers, "checkpoint_dtype": "bfloat16",
                                 "world": 4, "path": "transformers ZeRO-3 from_pretrained", "ranks": ranks})
        return
    for r in ranks:
        print(f"rank {r['rank']}: from_pretrained {r['load_s']:.1f} s, peak {r['load_peak'] / MiB:.0f} MiB "
              f"(formula {r['load_formula'] / MiB:.0f}, {r['load_peak'] / r['load_formula']:.2f}x); initialize "
              f"{r['init_s']:.1f} s, peak {r['init_peak'] / MiB:.0f} MiB (formula {r['init_formula'] / MiB:.0f}, "
              f"{r['init_peak'] / r['init_formula']:.2f}x)")
    write_results(args.out, {"parameters": params, "layers": args.layers, "checkpoint_dtype": "bfloat16",
                             "world": 4, "ranks": ranks})


if __name__ == "__main__":
    main()
