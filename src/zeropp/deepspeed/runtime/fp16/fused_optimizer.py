"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, DeepSpeed's stage-0 fp16 wrapper for its fused Adam.
zeropp never builds one (DeepSpeed's FusedAdam is not provided: a config's Adam is torch's, so stage 0 in 16 bits
holds ``FP16_UnfusedOptimizer``); the class is here for the ``isinstance`` checks scripts and DeepSpeed's tests
make, which answer False. Constructing one raises ``DeepSpeedAPIError`` saying what to use instead."""
from __future__ import annotations

from typing import Any

from zeropp.deepspeed.missing import DeepSpeedAPIError

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's fused fp16 optimizer wrapper; never built by zeropp (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DeepSpeedAPIError("DeepSpeed's deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer is not built by "
                                "zeropp: use the optimizer deepspeed.initialize returns (engine.optimizer)")
