"""A LoRA-style fine-tuning set-up written the way research code does it (no peft): a real ``transformers``
Llama whose every weight is frozen, with small trainable low-rank adapters beside its attention projections."""
from __future__ import annotations

import torch
from torch import nn

from support.hf_models import llama


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
