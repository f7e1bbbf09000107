"""A transformers Llama built under ``zero.Init`` and trained on 2 nodes x 2 ranks with ZeRO++ and the default
buffers (no bucket keys): each rank's peak RSS over a bare process, next to ``engine.memory_report()``'s peak
and to the planner's formula (model states + gathered units in flight + gradient buckets + activations,
``zeropp.tools.plan.memory.memory``). Used by tests/dist/test_memory_scale.py (100M parameters) and
bench/bench_memory_scale.py (0.1B to 1.06B).

Run it with glibc's mmap threshold fixed (``support.rss.MALLOC_ENV``): otherwise freed multi-MB tensors stay
in a heap that RSS keeps counting (see there).
"""
from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


@dataclass(frozen=True)
class Size:
    """A Llama shape (untied embeddings, as Llama 2 ships them)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int = 32000

    def hf_config(self, seq: int) -> Any:
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.heads, max_position_embeddings=seq, tie_word_embeddings=False)


SIZES = {
    "0.1B": Size(layers=8, hidden=768, intermediate=2048, heads=12),  # 106M
    "0.4B": Size(layers=16, hidden=1280, intermediate=3456, heads=10),  # 0.40B
    "0.55B": Size(layers=16, hidden=1536, intermediate=4096, heads=12),  # 0.55B
    "1.06B": Size(layers=18, hidden=2048, intermediate=5632, heads=16),  # 1.06B
}


def config(micro: int, bf16: bool, nvme: Optional[str] = None) -> dict:
    """ZeRO++ with the default buffers; ``nvme``: parameters and optimizer states in files there instead
    (ZeRO-Infinity), and no hpZ (its secondary copy is the memory that offload gives back)."""
    zero: dict[str, Any] = {"stage": 3, **ZEROPP}
    if nvme is not None:
        where = {"device": "nvme", "nvme_path": os.path.join(nvme, "rank")}
        zero.update(zero_hpz_partition_size=1, offload_param=dict(where), offload_optimizer=dict(where))
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero, "topology": {"ranks_per_node": 2}}


def train_memory(rank: int, world: int, size: dict, micro: int, seq: int, steps: int, bf16: bool,
                 nvme: Optional[str] = None) -> dict:
    """Build under ``zero.Init``, ``steps`` optimizer steps; RSS measured from the bare process on. With
    ``nvme`` the formula's model states are those the rank keeps in memory (``memory_report``'s, measured)."""
    import torch

    import zeropp
    from support.rss import current_rss, peak_rss, reset_peak_rss
    from transformers import LlamaForCausalLM
    from zeropp.tools.plan.choices import Choice
    from zeropp.tools.plan.memory import memory
    from zeropp.tools.plan.model import from_module

    shape = Size(**size)
    cfg = config(micro, bf16, None if nvme is None else os.path.join(nvme, str(rank)))
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # a bare training process has Dynamo imported
    gc.collect()
    bare = current_rss()
    reset = reset_peak_rss()
    with zeropp.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(shape.hf_config(seq))
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    built = peak_rss(reset) - bare
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, shape.vocab, (micro, seq), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        states = engine.model_state_bytes()["total"]  # the step's most: gradients reduced, moments kept
        engine.step()
        losses.append(float(loss.detach()))
    peak = peak_rss(reset) - bare
    report = engine.memory_report()
    spec = from_module(engine.module)
    choice = Choice(3, 8, 1 if nvme else 2, 4)
    formula = memory(spec, choice, world, micro, seq, engine.reduce_bucket_size, checkpointing=False, bf16=bf16,
                     separate_device=False)
    resident = report["model_states"]["total"] if nvme else formula.states["total"]
    out = {"size": size, "parameters": spec.params, "bare_rss": bare, "built_rss": built, "peak_rss": peak,
           "report_peak": report["peak_bytes"], "report": {k: report[k] for k in (
               "buffer_bytes", "buffer_bound", "gathered_weights_peak")},
           "saved_activations": report["activations"]["saved_peak_device"],
           "model_states": states,
           "formula": {"states": resident, "working": formula.working, "activations": formula.activations,
                       "total": resident + formula.working + formula.activations},
           "nvme": nvme is not None,
           "bucket": engine.reduce_bucket_size, "losses": losses, "rss_reset": reset, "config": cfg}
    engine.close()
    return out


def as_row(name: str, ranks: list[dict]) -> dict:
    """One table row: the largest rank's numbers (the one that decides whether the job fits)."""
    worst = max(ranks, key=lambda r: r["peak_rss"])
    return {"model": name, "parameters": worst["parameters"], "peak_rss": worst["peak_rss"],
            "report_peak": worst["report_peak"], "formula": worst["formula"]["total"],
            "buffers": worst["report"]["buffer_bytes"], "model_states": worst["model_states"],
            "peak_over_report": worst["peak_rss"] / worst["report_peak"],
            "peak_over_formula": worst["peak_rss"] / worst["formula"]["total"], "ranks": ranks,
            "shape": asdict(Size(**worst["size"]))}
