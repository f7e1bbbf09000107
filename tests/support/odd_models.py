"""Models in the style of research code, not written for the engine: each reads a parameter somewhere other
than its owning module's forward (Note [external reads] in zeropp/zero/param_use.py)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 101, 6


class ChildWeight(nn.Module):
    """The issue's model: the parent multiplies by its embedding child's weight after the child ran."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 37)
        self.l1 = nn.Linear(37, 53)
        self.norm = nn.LayerNorm(53)
        self.l2 = nn.Linear(53, 37, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.l2(torch.relu(self.norm(self.l1(self.emb(x)))))
        logits = h @ self.emb.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class _Borrower(nn.Module):
    """Projects with another module's weight, held by a plain reference (not registered as a child)."""

    def __init__(self, source: nn.Linear, dim: int) -> None:
        super().__init__()
        self._source = [source]  # a list, so nn.Module does not register it
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._source[0].weight) + self.bias


class SiblingShare(nn.Module):
    """One Linear's weight used by it and by a sibling inside a block (block granularity lifts both)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            first = nn.Linear(24, 24)
            self.blocks.append(nn.ModuleDict({"first": first, "norm": nn.LayerNorm(24)}))
        self.second = _Borrower(self.blocks[0]["first"], 24)  # a sibling outside the block reads block 0's weight
        self.head = nn.Linear(24, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block["norm"](block["first"](h)))
        h = torch.tanh(self.second(h))
        return F.cross_entropy(self.head(h).float().flatten(0, 1), labels.flatten())


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.fc(self.norm(h)))


class ParentAfterChild(nn.Module):
    """The parent reads a LayerNorm gain deep inside the last layer after that layer's forward ended."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 20)
        self.layers = nn.ModuleList(_Layer(20) for _ in range(3))
        self.head = nn.Linear(20, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        h = h * self.layers[-1].norm.weight + self.layers[0].fc.bias  # read after those forwards ended
        h = h.to(self.head.weight.dtype)  # metadata only: must not gather the head early
        return F.cross_entropy(self.head(h).float().flatten(0, 1), labels.flatten())


class _GradGate(torch.autograd.Function):
    """Identity in forward; its backward scales the incoming gradient by ``w`` (saved, read only there)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(h, w)
        return h.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        h, w = ctx.saved_tensors
        return g * w, (g * h).sum(dim=tuple(range(g.dim() - 1)))


class _Gates(nn.Module):
    """Holds the gate parameters; its forward never runs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(1.0 + 0.5 * torch.randn(dim))


class BackwardOnly(nn.Module):
    """A parameter that the forward never reads: a custom function saves it for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(_Layer(16) for _ in range(2))
        self.gates = _Gates(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.emb(x))
        h = self.layers[1](_GradGate.apply(h, self.gates.w))
        return F.cross_entropy(self.head(h).float().flatten(0, 1), labels.flatten())


class CalledTwice(nn.Module):
    """One layer applied twice per forward (weight sharing across depth, as in ALBERT or universal
    transformers), and a frozen projection in the middle whose backward needs its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 18)
        self.layers = nn.ModuleList([_Layer(18), _Layer(18)])
        self.frozen = nn.Linear(18, 18)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(18, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.layers[0](h)
        h = self.frozen(h)
        h = self.layers[1](self.layers[0](h))
        return F.cross_entropy(self.head(h).float().flatten(0, 1), labels.flatten())


MODELS: dict[str, Callable[[], nn.Module]] = {
    "child_weight": ChildWeight, "sibling_share": SiblingShare, "parent_after_child": ParentAfterChild,
    "backward_only": BackwardOnly, "called_twice": CalledTwice,
}


def odd_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return x, torch.roll(x, 1, dims=1)
