"""``deepspeed.runtime.engine.DeepSpeedEngine`` (also ``deepspeed.DeepSpeedEngine``): the class of the engines the
alias's ``initialize`` returns, for the ``isinstance`` checks integrations make.

It is zeropp's engine with two differences, both DeepSpeed's behaviour:

* ``engine.optimizer`` is DeepSpeed's ZeRO optimizer (the view in ``runtime/zero/zero_optimizer.py``), as scripts
  written for DeepSpeed read it, where zeropp's own engine answers with the torch optimizer over the fp32 masters
  (which both keep as ``master_optimizer``);
* ``forward`` passes floating-point inputs as they are, casting them to fp16 only with ``fp16.auto_cast``, where
  zeropp's own engine casts them to the compute dtype (a bf16 model given fp32 inputs computes in fp32 where the
  weights meet them, as under DeepSpeed);

and raises DeepSpeed's exception type where a script may catch it: a parameter without a gradient under
``ignore_unused_parameters: false`` is an ``AssertionError`` (zeropp's :class:`UnusedParametersError`, a
RuntimeError, is its cause).
"""
from __future__ import annotations

from typing import Any

import torch

from zeropp.checkpoint import CheckpointingEngine
from zeropp.compat.deepspeed.runtime.zero.zero_optimizer import ZeroOptimizerView, zero_optimizer_view
from zeropp.zero.engine import UnusedParametersError


class DeepSpeedEngine(CheckpointingEngine):
    """zeropp's engine as DeepSpeed's scripts see it (see the module docstring). Made by ``initialize``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("DeepSpeedEngine is made by deepspeed.initialize(model=..., config=...), not directly")

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(loss, *args, **kwargs)
        except UnusedParametersError as e:
            raise AssertionError(str(e)) from e

    @property
    def casts_inputs(self) -> bool:  # type: ignore[override]
        fp16 = self.config.fp16
        return bool(fp16.enabled and fp16.auto_cast)

    @property
    def optimizer(self) -> ZeroOptimizerView:  # type: ignore[override]
        view = self.__dict__.get("_deepspeed_optimizer")
        if view is None:  # one per engine, made at first use
            view = self.__dict__["_deepspeed_optimizer"] = zero_optimizer_view(self)
        return view


def as_deepspeed_engine(engine: CheckpointingEngine) -> DeepSpeedEngine:
    """The engine ``initialize`` made, as a :class:`DeepSpeedEngine` (the same object: its class changes)."""
    if type(engine) is not CheckpointingEngine:
        raise TypeError(f"the DeepSpeed alias expects the engine initialize makes, got {type(engine).__name__}")
    engine.__class__ = DeepSpeedEngine
    return engine  # type: ignore[return-value]
