"""What the plan needs to know about a model: its gather units (parameter sizes, in the order the engine meets
them) and its compute per token.

Three sources: an ``nn.Module`` (exact: the units ``partition.assign.plan_units`` makes), a Hugging Face
``config.json`` (a decoder-only transformer's shapes), or a bare parameter count (a GPT-shaped model of that
size). Units are listed in forward order with the root unit (embeddings, final norm, a tied head) first: the
engine gathers the root before the first block and keeps it until the loss, so its compute (the head) runs
last in forward and first in backward.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from zeropp.tools.plan.profile import PlanError, read_json_file


@dataclass(frozen=True)
class UnitSpec:
    """One gather unit: its parameters' element counts (definition order) and its share of the compute."""

    name: str
    numels: tuple[int, ...]
    flops_per_token: float  # forward FLOPs per token spent in this unit (2 x its matmul weights)

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True)
class ModelSpec:
    """Units in forward order (``units[0]`` is the root), plus the shapes activation memory depends on."""

    name: str
    units: tuple[UnitSpec, ...]
    layers: int
    hidden: int
    heads: int
    seq_len_max: Optional[int] = None

    @property
    def params(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def numels(self) -> list[int]:
        return [n for u in self.units for n in u.numels]

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs per token in forward: 2 x the weights each token meets, plus attention's scores and
        mixing (2 x 2 x seq x hidden per layer, causal halves it: the "6 N T" convention keeps only weights)."""
        return sum(u.flops_per_token for u in self.units) + 2.0 * self.layers * seq_len * self.hidden


def _block_numels(d: int, ff: int, gated: bool, bias: bool, kv: int) -> tuple[tuple[int, ...], float]:
    """A pre-norm transformer block: (numels in definition order, matmul weights)."""
    qkv = d * (d + 2 * kv)
    attn = [d, d] if bias else [d]  # norm 1
    attn += [qkv] + ([d + 2 * kv] if bias else []) + [d * d] + ([d] if bias else [])
    mlp = [d, d] if bias else [d]  # norm 2
    mats = [d * ff] * (3 if gated else 2)
    for i, m in enumerate(mats):
        mlp += [m] + ([ff if i < len(mats) - 1 else d] if bias else [])
    return tuple(attn + mlp), float(qkv + d * d + sum(mats))


def transformer(name: str, layers: int, hidden: int, heads: int, vocab: int, ff: Optional[int] = None,
                positions: int = 0, tied: bool = True, gated: bool = False, bias: bool = True,
                kv_heads: Optional[int] = None, seq_len_max: Optional[int] = None) -> ModelSpec:
    """A decoder-only transformer: root unit (token and position embeddings, final norm, head if untied) and
    one unit per block (``gather_granularity: "block"``)."""
    ff = ff or 4 * hidden
    kv = hidden * (kv_heads or heads) // heads
    numels, mats = _block_numels(hidden, ff, gated, bias, kv)
    root = [vocab * hidden] + ([positions * hidden] if positions else []) + ([hidden, hidden] if bias else [hidden])
    if not tied:
        root.append(vocab * hidden)
    units = [UnitSpec("root", tuple(root), 2.0 * vocab * hidden)]
    units += [UnitSpec(f"block{i}", numels, 2.0 * mats) for i in range(layers)]
    return ModelSpec(name, tuple(units), layers, hidden, heads, seq_len_max)


def gpt_of_size(params: float) -> ModelSpec:
    """A GPT-shaped model of about ``params`` parameters: width about 100 x depth (GPT-3's table runs 64-130),
    width a multiple of 128, vocabulary 50,304."""
    if not params > 0:
        raise PlanError(f"--model: the parameter count must be positive, got {params}")
    vocab = 50_304
    layers = max(1, round((params / (12 * 100.0 ** 2)) ** (1 / 3)))
    # 12 L h^2 + vocab h = params, solved for h and rounded to a multiple of 128
    hidden = (-vocab + (vocab ** 2 + 48 * layers * params) ** 0.5) / (24 * layers)
    hidden = max(128, int(round(hidden / 128)) * 128)
    heads = max(1, hidden // 128)
    return transformer(f"GPT {params / 1e9:.3g}B", layers, hidden, heads, vocab, positions=2048)


_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_params(text: str) -> Optional[float]:
    """``"19.9M"``, ``"18B"``, ``"1.2e9"``, ``"350000000"`` -> a count; None when ``text`` is not a count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        return None
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def from_hf_config(raw: dict[str, Any], source: str) -> ModelSpec:
    """A Hugging Face decoder config (GPT-2, Llama, Mistral, Qwen, OPT, GPT-NeoX names)."""
    def pick(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if raw.get(k) is not None:
                return raw[k]
        if default is None:
            raise PlanError(f"--model {source}: none of {', '.join(keys)} is set (not a decoder config?)")
        return default

    hidden = int(pick("hidden_size", "n_embd", "d_model"))
    layers = int(pick("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(pick("num_attention_heads", "n_head"))
    vocab = int(pick("vocab_size"))
    ff = int(pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden)
    model_type = str(raw.get("model_type", ""))
    gated = model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "phi3") or \
        str(raw.get("hidden_act", "")) in ("silu", "swiglu")
    positions = int(raw.get("n_positions") or raw.get("max_position_embeddings") or 0) \
        if model_type in ("gpt2", "opt", "gpt_bigcode") else 0
    tied = bool(raw.get("tie_word_embeddings", True))
    bias = model_type in ("gpt2", "opt", "gpt_neox", "gpt_bigcode", "bloom")
    seq = raw.get("max_position_embeddings") or raw.get("n_positions") or raw.get("n_ctx")
    return transformer(f"{model_type or 'hf'} {source}", layers, hidden, heads, vocab, ff, positions, tied, gated,
                       bias, raw.get("num_key_value_heads"), int(seq) if seq else None)


def from_module(module: Any, granularity: str = "block") -> ModelSpec:
    """The exact units the engine would make for ``module`` (root unit first, then definition order)."""
    from zeropp.partition.assign import plan_units

    plans = plan_units(module, granularity)
    plans.sort(key=lambda p: p.module_name != "")  # the root's pre-hook runs first
    units = []
    for p in plans:
        mats = sum(t.numel() for _, t in p.params if t.dim() >= 2)
        units.append(UnitSpec(p.module_name or "root", tuple(t.numel() for _, t in p.params), 2.0 * mats))
    cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
    hidden = int(getattr(cfg, "n_embd", 0) or getattr(cfg, "hidden_size", 0) or 0)
    layers = int(getattr(cfg, "n_layer", 0) or getattr(cfg, "num_hidden_layers", 0) or 0)
    heads = int(getattr(cfg, "n_head", 0) or getattr(cfg, "num_attention_heads", 0) or 1)
    return ModelSpec(type(module).__name__, tuple(units), layers, hidden, heads)


def demo_gpt(n_layer: int, n_embd: int, n_head: int, block_size: int) -> ModelSpec:
    """``zeropp.tools.demo.model.GPT`` (the bench's model), built on the meta device to read its exact units."""
    import torch

    from zeropp.tools.demo.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size))
    spec = from_module(model)
    return ModelSpec(f"demo GPT {spec.params / 1e6:.1f}M", spec.units, n_layer, n_embd, n_head, block_size)


def load_model(text: str) -> tuple[ModelSpec, Optional[dict[str, Any]]]:
    """``--model``: a parameter count, a Hugging Face ``config.json`` or a zeropp/DeepSpeed config.

    Returns the model (None for a DeepSpeed config: its size comes from ``--params``) and the DeepSpeed config
    when one was given (its batch, precision and buckets become the plan's base settings).
    """
    count = parse_params(text)
    if count is not None:
        return gpt_of_size(count), None
    raw = read_json_file("--model", text, missing="not a parameter count (like 18B or 1.3e9) and no such file")
    if not isinstance(raw, dict):
        raise PlanError(f"--model {text}: the top level must be a JSON object")
    if "zero_optimization" in raw or any(k.startswith("train_") for k in raw):
        return None, raw  # type: ignore[return-value]
    return from_hf_config(raw, text), None


def activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, checkpointing: bool,
                     elem_bytes: int = 2) -> int:
    """Activation memory of one micro-batch, estimated (Korthikanti et al. 2022, eq. 2, no parallelism):
    ``s b h (34 + 5 a s / h)`` bytes per layer in 16-bit; with checkpointing only each layer's input
    (``2 s b h``) plus one layer's full set. The plan treats this as an estimate, not a ledger fact."""
    s, b, h, a = seq_len, micro_batch, max(model.hidden, 1), max(model.heads, 1)
    per_layer = s * b * h * (34 + 5 * a * s / h) * elem_bytes / 2
    layers = max(model.layers, 1)
    if checkpointing:
        return int(layers * s * b * h * elem_bytes + per_layer)
    return int(layers * per_layer)


def flops_per_step(model: ModelSpec, tokens: int, seq_len: int, checkpointing: bool) -> float:
    """Forward + backward FLOPs of one micro-batch: 3 x forward (6 N T), plus one more forward when
    activation checkpointing recomputes it."""
    return (4.0 if checkpointing else 3.0) * model.forward_flops_per_token(seq_len) * tokens

