"""The tiny model, data and loss behind the DeepSpeed 0.19.8 reference checkpoints in tests/data/deepspeed.

Pure torch (no DeepSpeed import): tests/data/deepspeed/make_checkpoints.py trains this model with DeepSpeed,
and the tests can rebuild the same model, batches and loss without DeepSpeed to check an imported checkpoint.

Parameters, in ``named_parameters()`` order (a module's own parameters come before its children's;
534 elements, 534 % 4 == 2 so ZeRO-1/2 with 2 ranks pads the flat group by 2):

    out_scale    (1,)        1   <- odd numel; in ZeRO-3 with 2 ranks rank 1's piece of it is all padding
    fc1.weight   (16, 8)   128
    fc1.bias     (16,)      16
    norm.weight  (16,)      16
    norm.bias    (16,)      16
    fc2.weight   (16, 16)  256
    fc2.bias     (16,)      16
    head.weight  (5, 16)    80
    head.bias    (5,)        5   <- odd numel

One persistent buffer, ``out_shift`` (5,), fp32 at construction, never trained.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

IN_DIM = 8
HIDDEN = 16
OUT_DIM = 5
MICRO_BATCH = 2  # per rank


class DsRefModel(nn.Module):
    """Linear(8,16) -> LayerNorm(16) -> GELU -> Linear(16,16) -> Linear(16,5), times a 1-element gain, plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT_DIM)
        self.out_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("out_shift", torch.tensor([0.25, -0.5, 0.125, 0.0, 1.0]), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        h = self.fc2(h)
        return self.head(h) * self.out_scale + self.out_shift


def make_model(seed: int = 0) -> DsRefModel:
    """The model with deterministic weights: ``torch.manual_seed(seed)`` then default init, then a seeded
    perturbation of the LayerNorm affine parameters and ``out_scale`` so they are not all ones/zeros."""
    torch.manual_seed(seed)
    model = DsRefModel()
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        model.norm.weight.add_(0.1 * torch.randn(HIDDEN, generator=g))
        model.norm.bias.add_(0.1 * torch.randn(HIDDEN, generator=g))
        model.out_scale.add_(0.1 * torch.randn(1, generator=g))
    return model


def ds_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch for optimizer step ``step``: x (2, 8) and y (2, 5), fp32, deterministic."""
    g = torch.Generator().manual_seed(7919 * (step + 1) + 104_729 * (rank + 1))
    x = torch.randn(MICRO_BATCH, IN_DIM, generator=g)
    y = torch.randn(MICRO_BATCH, OUT_DIM, generator=g)
    return x, y


def _param_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def ds_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """MSE of ``model(x)`` against ``y``, computed in fp32. ``x`` is cast to ``dtype`` (default: the dtype of the
    model's first parameter, so a bf16 engine gets bf16 inputs)."""
    out = model(x.to(dtype or _param_dtype(model)))
    return F.mse_loss(out.float(), y.float())
