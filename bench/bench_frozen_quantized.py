"""Frozen weights kept as int8 (``zero_quantized_nontrainable_weights``) on a LoRA fine-tune, side by side with
the same run keeping them in 16 bits: model-state memory per rank, gather bytes per step, loss and step time.

A ``transformers`` Llama built from a config (hidden 512, 4 layers, vocabulary 4096: 17M parameters, all
frozen) with rank-8 adapters on every q and v projection, bf16, stage 3, 2 simulated nodes x 2 gloo ranks,
micro-batch 2 x 128 tokens. Three engines train on the same batches, their steps interleaved so all see the
same machine load: ``plain`` (frozen weights as bf16 shards with fp32 masters, as before), ``int8`` (the
option) and ``int8_hpz`` (the option with ``zero_hpz_partition_size: 2``). Reported per engine: the model
states of the last step by kind, the bytes of the last step by phase and link, the losses, and the median
step time after the first step.

    .venv/bin/python bench/bench_frozen_quantized.py [--steps 20] [--out bench/results/frozen_quantized.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from results_io import RESULTS, write_results  # noqa: E402

VOCAB, SEQ, MICRO = 4096, 128, 2
VARIANTS = {"plain": {}, "int8": {"zero_quantized_nontrainable_weights": True},
            "int8_hpz": {"zero_quantized_nontrainable_weights": True, "zero_hpz_partition_size": 2}}


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from support.lora import add_lora
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    return add_lora(LlamaForCausalLM(cfg))


def train_interleaved(engines: dict, rank: int, world: int, steps: int) -> tuple[dict, dict]:
    """``steps`` steps of every engine on the same batches, their steps interleaved: per engine the step times
    and the losses (mean over ranks)."""
    times: dict[str, list[float]] = {n: [] for n in engines}
    losses: dict[str, list[float]] = {n: [] for n in engines}
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        for name, engine in engines.items():
            start = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            times[name].append(time.perf_counter() - start)
            value = loss.detach().float().reshape(1).clone()
            torch.distributed.all_reduce(value)
            losses[name].append(value.item() / world)
    return times, losses


def worker(rank: int, world: int, steps: int) -> dict:
    import zeropp
    engines = {}
    for name, zero in VARIANTS.items():
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, **zero}, "topology": {"ranks_per_node": 2}}
        engines[name] = zeropp.initialize(model=_model(), config=cfg)[0]
    times, losses = train_interleaved(engines, rank, world, steps)
    out: dict = {}
    for name, engine in engines.items():
        frozen = sum(p.numel() for p in engine.module.parameters() if not p.requires_grad)
        out[name] = {"median_step_s": statistics.median(times[name][1:]), "losses": losses[name],
                     "model_states": engine.model_state_bytes(), "comm": engine.comm_report(),
                     "frozen_params": frozen,
                     "trainable_params": sum(p.numel() for p in engine.module.parameters() if p.requires_grad)}
    plain = out["plain"]
    for name in ("int8", "int8_hpz"):
        r = out[name]
        r["loss_max_rel_diff_vs_plain"] = max(abs(a - b) / b for a, b in zip(r["losses"], plain["losses"]))
        r["step_time_ratio_vs_plain"] = r["median_step_s"] / plain["median_step_s"]
        # what the frozen weights cost per rank: 16-bit shard + fp32 master before, the int8 row now
        before = (plain["model_states"]["shard_16bit"] - r["model_states"]["shard_16bit"]
                  + plain["model_states"]["master_fp32"] - r["model_states"]["master_fp32"])
        r["frozen_bytes_before"] = before
        r["frozen_bytes_int8"] = r["model_states"]["frozen_quantized"]
        r["frozen_int8_over_16bit"] = r["frozen_bytes_int8"] / (before / 3)  # 16-bit is a third of 2 + 4 bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(RESULTS, "frozen_quantized.json"))
    args = ap.parse_args()
    from support.world import run_world
    res = run_world(worker, 4, args.steps, ranks_per_node=2)[0]
    print(f"frozen params {res['plain']['frozen_params']:,}, trainable {res['plain']['trainable_params']:,}")
    for name in VARIANTS:
        r = res[name]
        ms, comm = r["model_states"], r["comm"]
        inter = sum(v["inter_node_bytes"] for k, v in comm.items() if k.endswith("gather"))
        intra = sum(v["intra_node_bytes"] for k, v in comm.items() if k.endswith("gather"))
        line = (f"{name:9s} states/rank {ms['total'] / 2**20:7.2f} MiB  gathers inter {inter / 2**20:6.2f} MiB "
                f"intra {intra / 2**20:6.2f} MiB  step {r['median_step_s'] * 1e3:7.1f} ms  "
                f"final loss {r['losses'][-1]:.4f}")
        if name != "plain":
            line += (f"  frozen int8/16-bit {r['frozen_int8_over_16bit']:.4f}  loss rel diff "
                     f"{r['loss_max_rel_diff_vs_plain']:.2e}  step ratio {r['step_time_ratio_vs_plain']:.2f}")
        print(line)
    res["command"] = "python bench/bench_frozen_quantized.py " + " ".join(sys.argv[1:])
    write_results(args.out, res)


if __name__ == "__main__":
    main()
