"""A LoRA-style fine-tuning set-up written the way research code does it (no peft): a real ``transformers``
Llama whose every weight is frozen, with small trainable low-rank adapters beside its attention projections."""
from __future__ import annotations

import torch
from torch import nn

from support.hf_models import hf_batch, hf_loss, llama


class LoraLinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen and rank-``r`` factors ``A``, ``B`` trainable."""

    def __init__(self, base: nn.Linear, r: int = 4, scale: float = 2.0) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # not zero: A trains from the first step too
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_B(self.lora_A(x))


def add_lora(model: nn.Module) -> nn.Module:
    """Freeze a ``transformers`` Llama and put adapters on every layer's q and v projections."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoraLinear(layer.self_attn.v_proj)
    return model


def lora_llama(seed: int = 0) -> nn.Module:
    """The small Llama of ``hf_models`` with adapters (:func:`add_lora`)."""
    torch.manual_seed(seed)
    return add_lora(llama())


def train_lora(engine, rank: int, steps: int, first: int = 0, world: int = 4, global_batch: int = 8) -> list[float]:
    """Optimizer steps on the same global batches whatever the world size; the loss of each (rank mean)."""
    micro, losses = global_batch // world, []
    for step in range(first, first + steps):
        x, y = hf_batch(step, global_batch)
        loss = hf_loss(engine, x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1).clone()
        torch.distributed.all_reduce(value)
        losses.append(value.item() / world)
    return losses
