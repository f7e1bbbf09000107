"""``deepspeed.runtime``: the ``zero`` subpackage and ``engine.DeepSpeedEngine``."""
from zeropp.deepspeed.runtime import engine, zero

__all__ = ["engine", "zero"]
