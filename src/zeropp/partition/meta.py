"""Partitioned construction: real weights for a model built on the meta device, one unit at a time.

Build the model under ``with torch.device("meta"):`` (no memory), hand it to ``zeropp.initialize`` with a
``param_init_fn``; each gather unit's parameters are then created on the host, initialized, cut into this
rank's shard and freed before the next unit's exist. Peak memory is the shards plus one unit (and the
modules sharing its parameters), never the whole model.

A meta tensor's storage cannot be swapped in place (``param.data = cpu_tensor`` is refused), so each meta
parameter is replaced by a new ``nn.Parameter`` in every module that holds it, which keeps tied weights
tied. Every rank runs the same initialization sequence, so with the same seed all ranks agree on every
value, and each keeps only its chunk.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from zeropp.partition.assign import UnitPlan


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``; modules without one must be covered by a ``param_init_fn``."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device but no reset_parameters(); pass "
            "param_init_fn=... to zeropp.initialize to initialize it"
        )
    reset()


class MetaMaterializer:
    """Replaces meta parameters (and buffers) with host tensors, a unit's holder modules at a time."""

    def __init__(self, root: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
        self.init_fn = init_fn or default_init
        self.modules = [m for _, m in root.named_modules()]
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in self.modules:
            for attr, p in module._parameters.items():
                if p is not None:
                    self.holders.setdefault(id(p), []).append((module, attr))
        self.replaced: dict[int, nn.Parameter] = {}
        self.initialized: set[int] = set()

    @staticmethod
    def needed(root: nn.Module) -> bool:
        return any(p.is_meta for p in root.parameters()) or any(b.is_meta for b in root.buffers())

    def realize(self, plan: UnitPlan) -> UnitPlan:
        """Give every parameter of ``plan`` real, initialized values; return the plan with the new objects."""
        wanted = {id(self.replaced.get(id(p), p)) for _, p in plan.params}
        wanted |= {id(p) for _, p in plan.params}
        owners = {id(m): m for pid in wanted for m, _ in self.holders.get(pid, [])}
        for module in self.modules:  # definition order: the same on every rank
            if id(module) in owners:
                self._realize_module(module)
        return UnitPlan(plan.module_name, plan.module,
                        [(name, self.replaced.get(id(p), p)) for name, p in plan.params])

    def _realize_module(self, module: nn.Module) -> None:
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                self._replace(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = torch.empty(b.shape, dtype=b.dtype)
        if id(module) not in self.initialized:
            self.initialized.add(id(module))
            if module._parameters or module._buffers:
                with torch.no_grad():
                    self.init_fn(module)

    def _replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        for module, attr in self.holders[id(old)]:
            module._parameters[attr] = new
        self.holders[id(new)] = self.holders.pop(id(old))
        self.replaced[id(old)] = new

    def finish(self) -> None:
        """Realize buffers of modules that hold no parameters, and check nothing is left on meta."""
        for module in self.modules:
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                self._realize_module(module)
        for module in self.modules:
            for attr, p in module._parameters.items():
                if p is not None and p.is_meta:
                    raise RuntimeError(f"parameter {attr!r} of {type(module).__name__} is still on the meta device")
