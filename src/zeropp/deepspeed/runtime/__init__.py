"""``deepspeed.runtime``: the ``zero`` subpackage, ``engine.DeepSpeedEngine``, ``config.DeepSpeedConfig``,
``activation_checkpointing``, ``utils.see_memory_usage``, ``lr_schedules``, and the optimizer classes scripts check
with ``isinstance`` (``bf16_optimizer``, ``fp16``)."""
from zeropp.deepspeed.runtime import (activation_checkpointing, bf16_optimizer, config, engine, fp16, lr_schedules,
                                      utils, zero)

__all__ = ["activation_checkpointing", "bf16_optimizer", "config", "engine", "fp16", "lr_schedules", "utils", "zero"]
