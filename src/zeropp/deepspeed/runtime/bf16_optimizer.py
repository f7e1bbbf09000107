"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer``, DeepSpeed's wrapper for bf16 at stage 1 with fp32
gradient accumulation (and for pipelines). zeropp never builds one: bf16 runs through its ZeRO optimizer at every
stage, as DeepSpeed's runs through its ZeRO optimizer for every other ZeRO config. So code written for DeepSpeed
may import the class, patch its methods or test ``isinstance(engine.optimizer, BF16_Optimizer)`` (False, as in
DeepSpeed for those configs); constructing one raises ``DeepSpeedAPIError`` saying what to use instead."""
from __future__ import annotations

from typing import Any

from zeropp.deepspeed.missing import DeepSpeedAPIError

__all__ = ["BF16_Optimizer"]


class BF16_Optimizer:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's bf16 optimizer wrapper; never built by zeropp (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise DeepSpeedAPIError(
            "DeepSpeed's deepspeed.runtime.bf16_optimizer.BF16_Optimizer is not built by zeropp: bf16 trains through "
            "zeropp's ZeRO optimizer at every stage; use the optimizer deepspeed.initialize returns "
            "(engine.optimizer) with \"bf16\": {\"enabled\": true} in the config")

    def destroy(self) -> None:
        """DeepSpeed's clean-up hook (scripts patch it); there is never an instance to clean up."""
