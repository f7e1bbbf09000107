"""Train a tiny GPT-2 with Hugging Face's Trainer through zeropp: ZeRO-3 + qwZ + hpZ + qgZ, in bf16.

    torchrun --nproc-per-node 4 examples/hf_trainer.py --out runs/hf_trainer

Four processes play 2 nodes x 2 ranks (the config's ``"topology": {"ranks_per_node": 2}``), so hpZ's secondary
copy stays inside each simulated node and qwZ/qgZ quantize what crosses between them. Nothing is downloaded:
the model is built from a ``GPT2Config`` and the data is the Shakespeare corpus shipped in ``zeropp.tools.demo``
(bytes as tokens). Writes ``OUT/losses.json`` (the Trainer's log) and ``OUT/model`` (``config.json`` +
``model.safetensors``, loadable with ``AutoModelForCausalLM.from_pretrained``); ``--config`` takes your own
DeepSpeed-style JSON instead of the one below.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import zeropp
from zeropp.tools.demo.data import ByteTokenizer, CorpusWindows
from zeropp.hf import ZeroppTrainer

# A Hugging Face-style config: "auto" is filled in from the TrainingArguments by ZeroppTrainer.
CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                      "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "zero_quantized_weights": True,   # qwZ: int8 forward all-gather
        "zero_hpz_partition_size": 2,     # hpZ: backward gathers stay inside a node of 2 ranks
        "zero_quantized_gradients": True,  # qgZ: int4 two-hop gradient all-to-all
    },
    "topology": {"ranks_per_node": 2},  # zeropp extension: 4 local processes = 2 nodes x 2
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/hf_trainer", help="output directory")
    p.add_argument("--config", default=None, help="a DeepSpeed-style JSON (default: the ZeRO++ config above)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8, help="per-rank batch (per_device_train_batch_size)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    return p.parse_args()


def main() -> None:
    opts = parse()
    # Join torchrun's process group through zeropp before TrainingArguments does it through accelerate: zeropp
    # keeps each restart attempt's rendezvous apart, so `torchrun --max-restarts` can restart the job.
    zeropp.init_distributed()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=ByteTokenizer.vocab_size, n_positions=opts.block_size, n_embd=opts.n_embd,
        n_layer=opts.n_layer, n_head=4, bos_token_id=0, eos_token_id=0))
    # transformers infers no loss type from the name "GPT2LMHeadModel"; the Trainer's token count needs it
    model.loss_type = "ForCausalLM"
    args = TrainingArguments(
        output_dir=os.path.join(opts.out, "trainer"), max_steps=opts.steps,
        per_device_train_batch_size=opts.micro_batch, gradient_accumulation_steps=opts.grad_accum,
        learning_rate=opts.lr, warmup_steps=0.1, weight_decay=0.1, logging_steps=1, save_strategy="no",
        bf16=True, use_cpu=not torch.cuda.is_available(), report_to=[], disable_tqdm=True,
        dataloader_drop_last=True, seed=0)
    config = opts.config if opts.config is not None else CONFIG
    trainer = ZeroppTrainer(model=model, args=args, train_dataset=CorpusWindows(opts.block_size, 2048),
                            zeropp_config=config)
    trainer.train()
    trainer.save_model(os.path.join(opts.out, "model"))  # every rank: the weights are gathered from all
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        zero = trainer.engine.config.zero_optimization
        on = [name for name, flag in (("qwZ", zero.zero_quantized_weights),
                                      ("hpZ", zero.zero_hpz_partition_size > 1),
                                      ("qgZ", zero.zero_quantized_gradients)) if flag]
        print(f"ZeRO-{zero.stage} + {' + '.join(on) or 'no ZeRO++'} on {trainer.engine.topo.num_nodes} nodes x "
              f"{trainer.engine.topo.ranks_per_node} ranks: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        with open(os.path.join(opts.out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "log": trainer.state.log_history}, f, indent=1)
        print(f"model saved to {os.path.join(opts.out, 'model')}")


if __name__ == "__main__":
    main()
