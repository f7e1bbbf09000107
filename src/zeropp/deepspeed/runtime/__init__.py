"""``deepspeed.runtime``: the ``zero`` subpackage, ``engine.DeepSpeedEngine`` and ``lr_schedules``."""
from zeropp.deepspeed.runtime import engine, lr_schedules, zero

__all__ = ["engine", "lr_schedules", "zero"]
