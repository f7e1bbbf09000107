"""Models built the way users build them, for tests/dist/test_construction.py: ``__init__`` code that writes
weights by hand, buffers computed from constructor arguments, and the README's meta-device init recipe."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH = 32, 16


class HandBlock(nn.Module):
    """A block whose ``__init__`` writes its own weights: one Linear from another's values, a gain set through
    ``.data``, a mask buffer."""

    def __init__(self, d: int, i: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight.t() * 0.5)  # built from another module's weights
        self.gain = nn.Parameter(torch.empty(d))
        self.gain.data.fill_(1.0 + 0.1 * i)
        self.register_buffer("mask", torch.tril(torch.ones(d, d)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.b(self.a(x)) @ self.mask) * self.gain


class HandNet(nn.Module):
    """Tied embedding and head; the parent writes its children's weights after they were built."""

    def __init__(self, d: int = WIDTH, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(HandBlock(d, i) for i in range(n))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.blocks[0].a.bias.zero_()
            self.embed.weight[0].fill_(0.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), idx[:, 1:].reshape(-1))


def hand_batch(step: int, rank: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (batch, 8), generator=g)


class EqualBlocks(nn.Module):
    """8 equal blocks of two square Linears (about 4.7M parameters, 19 MB in fp32, each)."""

    WIDTH = 1536

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        w = self.WIDTH
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(w, w), nn.Linear(w, w)) for _ in range(n)])

    def block_bytes(self) -> int:
        return 4 * 2 * (self.WIDTH * self.WIDTH + self.WIDTH)


class KeptRotary(nn.Module):
    """Rotary frequencies computed in ``__init__`` from arguments the module keeps: recomputable."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)


class LostRotary(nn.Module):
    """The same buffer from an argument the module does not keep: nothing can recompute it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)


class WithRotary(nn.Module):
    def __init__(self, kept: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rot = KeptRotary(8) if kept else LostRotary(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * self.rot.inv_freq.repeat(2)).sum()


class WithSkippedParam(nn.Module):
    """A parameter no ``reset_parameters`` covers: the README's recipe leaves it unwritten."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * self.scale).sum()


def readme_init(module: nn.Module) -> None:
    """The README's ``param_init_fn`` recipe: reset what has ``reset_parameters``, set the norms to 1."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
        module.weight.fill_(1.0)


class Broken(nn.Module):
    """Its ``__init__`` raises after a child was built (the context must clean up)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        raise RuntimeError("broken on purpose")
