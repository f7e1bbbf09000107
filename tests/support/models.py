"""Small models that exercise the awkward cases: sizes not divisible by the world, 1-D and tied parameters."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class TiedNet(nn.Module):
    """Token model whose output projection is the embedding (tied), with odd sizes and 1-D parameters."""

    def __init__(self, vocab: int = 13, dim: int = 7, hidden: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, dim)
        self.gain = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))  # a bare 1-D parameter
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.down(F.gelu(self.norm(self.up(h))))
        logits = self.head(h * self.gain)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tied_batch(step: int, global_batch: int, seq: int = 5, vocab: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (global_batch, seq), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    m = t.shape[0] // world
    return t[rank * m : (rank + 1) * m]


class MixedScales(nn.Module):
    """One unit holding a huge, a tiny and a one-element parameter; forward records what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(1000.0 * (1 + torch.rand(40)))
        self.small = nn.Parameter(1e-3 * (1 + torch.rand(30)))
        self.one = nn.Parameter(torch.tensor([0.5]))
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = {"big": self.big.detach().clone(), "small": self.small.detach().clone(),
                     "one": self.one.detach().clone()}
        return (x * self.small.sum() + self.big.mean() * 1e-6 + self.one).pow(2).mean()
