"""``deepspeed.runtime``: the ``zero`` subpackage, ``engine.DeepSpeedEngine``, ``lr_schedules`` and
``bf16_optimizer`` (whose names raise ``DeepSpeedAPIError``)."""
from zeropp.deepspeed.runtime import bf16_optimizer, engine, lr_schedules, zero

__all__ = ["bf16_optimizer", "engine", "lr_schedules", "zero"]
