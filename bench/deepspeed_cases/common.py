"""Shared helpers for the DeepSpeed-derived cases (bench/deepspeed_cases).

Cases import DeepSpeed only through `ds()`, so that the runner decides which implementation answers
`import deepspeed`: with ZEROPP_IMPL=zeropp the worker installs zeropp's alias before the import.
"""
import os

import torch
from torch import nn

CASES = []  # (name, world_size, function, kwargs)


def case(name, world=1, **kw):
    def deco(fn):
        CASES.append((name, world, fn, kw))
        return fn
    return deco


def param_cases(base, world, grid):
    """Register fn once per dict in grid: name base[k=v,...]."""
    def deco(fn):
        for kw in grid:
            tag = ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in kw.items())
            CASES.append((f"{base}[{tag}]", world, fn, kw))
        return fn
    return deco


def ds():
    import deepspeed
    return deepspeed


def rank():
    import torch.distributed as dist
    return dist.get_rank()


def world():
    import torch.distributed as dist
    return dist.get_world_size()


def adam(lr=1e-3, **extra):
    """DeepSpeed's config optimizer, adapted to torch's Adam (torch_adam) as the measurement asks."""
    p = {"lr": lr, "torch_adam": True}
    p.update(extra)
    return {"type": "Adam", "params": p}


def bf16():
    return {"enabled": True}


class SimpleModel(nn.Module):
    """Same shape as DeepSpeed's tests/unit/simple_model.py SimpleModel: linears + cross entropy."""

    def __init__(self, hidden_dim, empty_grad=False, nlayers=1):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        if empty_grad:
            self.layers2 = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x, y):
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for l in self.linears:
                x = l(x)
        return self.cross_entropy_loss(x, y)


def random_batches(engine_or_dtype, total_samples, hidden_dim, batch_size, seed=123, dtype=None):
    """(x, y) batches like DeepSpeed's random_dataloader: x ~ N(0,1) of the engine's dtype, y in [0, hidden)."""
    if dtype is None:
        dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total_samples, hidden_dim, generator=g).to(dtype)
    y = torch.empty(total_samples, dtype=torch.long).random_(hidden_dim, generator=g)
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, total_samples, batch_size)]


def engine_dtype(engine):
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def train(engine, batches):
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def expect_raises(exc_types, fn, *a, match=None, **k):
    try:
        fn(*a, **k)
    except exc_types as e:
        if match is not None:
            assert match in str(e), f"raised {type(e).__name__} without {match!r}: {e}"
        return e
    raise AssertionError(f"expected {exc_types} to be raised")


def destroy(engine):
    d = getattr(engine, "destroy", None)
    if d is not None:
        d()
