"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer``, the optimizer DeepSpeed's engine holds at
stage 0 in fp16 or bf16 (its wrapper around a torch optimizer, with fp32 copies of the weights and the loss scale).

zeropp's stage 0 steps a torch optimizer over fp32 master copies too, so this is the ZeRO optimizer view
(``runtime/zero/zero_optimizer.py``: ``optimizer``, ``param_groups``, ``state``, ``step()``, ``zero_grad()``,
``loss_scale``, ...) under DeepSpeed's stage-0 class, with its own attributes: ``low_precision_dtype``,
``loss_scale_config`` (``dynamic_loss_scale``, ``cur_scale``) and ``fp32_groups`` (each parameter group's fp32
masters, the tensors the torch optimizer steps).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zeropp.deepspeed.runtime.zero.zero_optimizer import ZeroOptimizerView

__all__ = ["FP16_UnfusedOptimizer", "LossScaleConfig"]


class LossScaleConfig(NamedTuple):
    """What DeepSpeed's ``optimizer.loss_scale_config`` answers: whether the scale moves, and its value now."""

    low_precision_dtype: torch.dtype
    dynamic_loss_scale: bool
    cur_scale: float


class FP16_UnfusedOptimizer(ZeroOptimizerView):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's stage-0 16-bit optimizer, as a view of a zeropp engine (see the module docstring)."""

    @property
    def low_precision_dtype(self) -> torch.dtype:
        return self._engine.policy.compute_dtype

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        scaler: Any = self._engine.loss_scaler  # fp16's; None in bf16, whose scale is a static 1
        return LossScaleConfig(self.low_precision_dtype, bool(scaler is not None and scaler.dynamic),
                               float(self._engine.loss_scale))

    @property
    def fp32_groups(self) -> list[list[torch.Tensor]]:
        """Each parameter group's fp32 masters (the torch optimizer's own tensors, one per parameter)."""
        return [list(group["params"]) for group in self.param_groups]
