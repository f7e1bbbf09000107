"""The optimizer ``deepspeed.initialize`` returns: DeepSpeed's ZeRO optimizer as scripts and DeepSpeed's own tests
read it, over the torch optimizer the engine steps.

DeepSpeed returns a wrapper (``DeepSpeedZeroOptimizer`` for stages 1-2, ``DeepSpeedZeroOptimizer_Stage3``) whose
``optimizer`` is the torch optimizer over fp32 partitions. zeropp's engine steps a torch optimizer over each
parameter's fp32 master chunk, so the wrapper here is a read-only view: ``optimizer`` is that torch optimizer
(its ``state[master]["step"]`` is Adam's step count), stage 3's ``fp16_groups`` / ``fp32_partitioned_groups_flat``
pair each master with its parameter (one sub-group per parameter), stages 1-2's ``bit16_groups`` /
``single_partition_of_fp32_groups`` do the same per parameter group. Stepping belongs to the engine
(``engine.step()``); a DeepSpeed name this view lacks raises :class:`DeepSpeedAPIError` naming it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from zeropp.zero import param_state as ps
from zeropp.zero.deepspeed_surface import DeepSpeedAPIError


class ZeroOptimizerView:
    """DeepSpeed's ZeRO optimizer attributes, read from a zeropp engine (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over the fp32 master chunks (DeepSpeed's ``optimizer.optimizer``)."""
        return self._engine.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self._engine.optimizer.state

    @property
    def defaults(self) -> dict:
        return self._engine.optimizer.defaults

    def _located(self) -> list[tuple[ps.Located, torch.Tensor]]:
        """(where the parameter lives, its fp32 master chunk) for every master the optimizer steps, in the
        optimizer's order."""
        engine = self._engine
        of_master = {id(view): ps.Located(engine, u, i) for u in engine.units
                     for i, view in enumerate(u.master_views())}
        return [(of_master[id(m)], m) for g in self.param_groups for m in g["params"] if id(m) in of_master]

    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, its fp32 master chunk) for every master the optimizer steps, in the optimizer's order."""
        return [(loc.slot.param, m) for loc, m in self._located()]

    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """Stage 3: the parameters of each sub-group (here one parameter each, as zeropp steps per parameter)."""
        return [[p] for p, _ in self._pairs()]

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """Stage 3: each sub-group's fp32 partition, the key of its state in ``optimizer.state``."""
        return [m for _, m in self._pairs()]

    @property
    def bit16_groups(self) -> list[list[torch.nn.Parameter]]:
        """Stages 1-2: the parameters of each parameter group."""
        params = {id(m): p for p, m in self._pairs()}
        return [[params[id(m)] for m in g["params"] if id(m) in params] for g in self.param_groups]

    @property
    def single_partition_of_fp32_groups(self) -> list[list[torch.Tensor]]:
        """Stages 1-2: each parameter group's fp32 partition (here the masters of its parameters)."""
        return [list(g["params"]) for g in self.param_groups]

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    cur_scale = loss_scale

    @property
    def _global_grad_norm(self) -> Optional[float]:
        """The gradients' global norm at the last step (before clipping), as DeepSpeed's optimizer keeps it."""
        return self._engine.get_global_grad_norm()

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """Each sub-group's gradient norm as the next step sees it (here one per parameter, the sub-groups of
        ``fp16_groups``); collective, so every rank calls. Their L2 norm is the global gradient norm."""
        return ps.grad_norms([loc for loc, _ in self._located()])

    def state_dict(self) -> dict:
        """This rank's part of the optimizer state (the torch optimizer's over its master chunks)."""
        return self._engine.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears its gradient shards at each optimizer step."""

    def step(self, closure: Any = None) -> None:
        raise DeepSpeedAPIError("the ZeRO optimizer's step(): call engine.step(), which reduces, clips and steps "
                                "at the accumulation boundary")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise DeepSpeedAPIError(f"the ZeRO optimizer's {name!r} is not provided by zeropp; it offers optimizer, "
                                "param_groups, state, fp16_groups, fp32_partitioned_groups_flat, bit16_groups, "
                                "single_partition_of_fp32_groups, loss_scale, _get_norm_groups, _global_grad_norm, "
                                "state_dict and zero_grad")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._engine.optimizer!r})"


class DeepSpeedZeroOptimizer(ZeroOptimizerView):
    """What ``deepspeed.initialize`` returns as the optimizer at stages 0-2 (DeepSpeed's name, for isinstance)."""


class DeepSpeedZeroOptimizer_Stage3(ZeroOptimizerView):  # noqa: N801 (DeepSpeed's class name)
    """What ``deepspeed.initialize`` returns as the optimizer at stage 3 (DeepSpeed's name, for isinstance)."""


def zero_optimizer_view(engine: Any) -> ZeroOptimizerView:
    """The view of DeepSpeed's ZeRO optimizer for ``engine``'s stage."""
    stage3 = engine.plan.shards_weights
    return DeepSpeedZeroOptimizer_Stage3(engine) if stage3 else DeepSpeedZeroOptimizer(engine)
