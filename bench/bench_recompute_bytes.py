"""Weight bytes gathered per step for a LoRA fine-tune with and without activation checkpointing, zeropp
against DeepSpeed 0.19.8 on the same model (Note [frozen units in backward] in ``partition/unit.py``).

A ``transformers`` Llama built from a config (hidden 256, 4 layers, vocabulary 1024: 5.0M parameters, all
frozen) with PEFT's rank-8 LoRA on every q and v projection, fp32, stage 3 on 2 gloo ranks, micro-batch
2 x 64 tokens, 3 steps. Checkpointing is transformers' own (``gradient_checkpointing_enable``, non-reentrant,
as TRL turns it on), under each system's defaults and with nothing kept gathered between uses (``SETTINGS``).
Reported per system and setting: the bytes of weight all-gathers this rank received in
the last step's forward and backward, and the losses. zeropp's come from its ledger (``comm_report()``);
DeepSpeed's from wrapping ``torch.distributed``'s all-gathers while its forward and backward run (its
prefetch counted where it is issued).

    DS_BUILD_OPS=0 .venv/bin/pip install deepspeed==0.19.8   # once (make bench does it)
    .venv/bin/python bench/bench_recompute_bytes.py [--out bench/results/recompute_bytes.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from results_io import RESULTS, write_results  # noqa: E402

VOCAB, SEQ, MICRO, STEPS = 1024, 64, 2, 3


def _model(checkpointing: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=SEQ))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


# "defaults": each system's own; "release": nothing persists or is kept for reuse, so every weight is gathered
# where it is used (DeepSpeed's defaults keep parameters under 100k elements gathered for good and hold the rest
# between forward and backward while stage3_max_reuse_distance allows it)
SETTINGS = {"defaults": {}, "release": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}


def _config(setting: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **SETTINGS[setting]},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


class _Counter:
    """Bytes this rank receives through ``torch.distributed``'s all-gathers, by the phase set from outside."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.phase = ""
        self.bytes: dict[str, int] = {}
        self._dist = dist
        self._saved = {}
        for name in ("all_gather_into_tensor", "all_gather"):
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._wrap(original))

    def _wrap(self, original):  # noqa: ANN001, ANN202
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list"))
            if self.phase:
                world = self._dist.get_world_size(kwargs.get("group"))
                tensors = out if isinstance(out, list) else [out]
                total = sum(t.numel() * t.element_size() for t in tensors)
                self.bytes[self.phase] = self.bytes.get(self.phase, 0) + total * (world - 1) // world
            return original(*args, **kwargs)
        return counted


def deepspeed_worker(rank: int, world: int, checkpointing: bool, setting: str) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    counter = _Counter()
    engine, *_ = deepspeed.initialize(model=_model(checkpointing), config=_config(setting))
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        counter.bytes = {}
        counter.phase = "forward"
        loss = engine(input_ids=x, labels=x).loss
        counter.phase = "backward"
        engine.backward(loss)
        counter.phase = ""
        engine.step()
        losses.append(loss.item())
    return {"forward_gather": counter.bytes.get("forward", 0), "backward_gather": counter.bytes.get("backward", 0),
            "losses": losses}


def zeropp_worker(rank: int, world: int, checkpointing: bool, setting: str) -> dict:
    import zeropp
    engine, *_ = zeropp.initialize(model=_model(checkpointing), config=_config(setting))
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.comm_report()
    total = lambda phase: sum(report.get(phase, {}).values())  # noqa: E731
    return {"forward_gather": total("forward_gather"), "backward_gather": total("backward_gather"),
            "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "recompute_bytes.json"))
    ap.add_argument("--skip-deepspeed", action="store_true")
    args = ap.parse_args()
    from support.world import run_world
    out: dict = {}
    systems = {"zeropp": zeropp_worker} if args.skip_deepspeed else {"zeropp": zeropp_worker,
                                                                      "deepspeed": deepspeed_worker}
    for setting in SETTINGS:
        for system, fn in systems.items():
            for checkpointing in (False, True):
                res = run_world(fn, 2, checkpointing, setting)[0]
                out[f"{setting}/{system}/{'checkpointing' if checkpointing else 'no checkpointing'}"] = res
                print(f"{setting:8s} {system:9s} checkpointing={checkpointing!s:5s} forward "
                      f"{res['forward_gather']:>10,} B  backward {res['backward_gather']:>10,} B  "
                      f"losses {[round(v, 5) for v in res['losses']]}", flush=True)
    write_results(args.out, out)


if __name__ == "__main__":
    main()
