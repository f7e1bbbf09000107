"""The benchmarked model, built the same way by the driver (to count parameters) and by every rank.

``demo``: zeropp's own GPT (``zeropp.tools.demo.model``). ``hf-gpt2``: ``transformers``' GPT2LMHeadModel built from a
``GPT2Config`` of the same shape (vocabulary 256: the shipped byte corpus; nothing downloaded), trained on the
same batches with the same loss, so that a model written without zeropp in mind is measured too.
``launch-bound``: ``n_layer`` blocks of a LayerNorm and two ``n_embd`` x ``n_embd`` Linears, so small that a step
is the libraries' host work per unit, not arithmetic (``bench/bench_host_cost.py``). All are called
``model(x, y)`` and return the mean next-token cross-entropy in fp32, and all keep their blocks at
``model.transformer.h`` (FSDP2 shards per block).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.tools.demo.model import GPT, GPTConfig

MODELS = ("demo", "hf-gpt2", "launch-bound")


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model of a bench spec's ``model`` section (``kind``: one of :data:`MODELS`, default ``demo``)."""
    kind = spec.get("kind", "demo")
    shape = {k: spec[k] for k in ("n_layer", "n_embd", "n_head", "block_size")}
    if kind == "demo":
        return GPT(GPTConfig(**shape))
    if kind == "hf-gpt2":
        return _hf_gpt2(**shape)
    if kind == "launch-bound":
        return LaunchBound(shape["n_layer"], shape["n_embd"])
    raise ValueError(f"unknown bench model {kind!r}; choose one of {', '.join(MODELS)}")


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _hf_gpt2(n_layer: int, n_embd: int, n_head: int, block_size: int) -> nn.Module:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as err:  # pragma: no cover - transformers is in the dev and bench extras
        raise ImportError("the hf-gpt2 bench model needs transformers (pip install -e '.[bench]')") from err

    class BenchGPT2(GPT2LMHeadModel):
        """GPT2LMHeadModel called as ``model(x, y)``: the loss against already shifted targets."""

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            logits = super().forward(input_ids=idx).logits
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    cfg = GPT2Config(vocab_size=256, n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                     bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 lies outside 256 bytes
    return BenchGPT2(cfg)


class _TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class LaunchBound(nn.Module):
    """Many tiny blocks over a byte embedding: the host cost per unit is the step."""

    def __init__(self, n_layer: int, width: int, vocab: int = 256) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(_TinyBlock(width) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
