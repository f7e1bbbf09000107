"""``deepspeed.runtime.lr_schedules``: the names of DeepSpeed's learning-rate schedules (accelerate checks
``type(obj).__name__ in VALID_LR_SCHEDULES`` for every object it prepares) and the schedules zeropp builds
(``zeropp/optim.py``), under DeepSpeed's class names and signatures. ``OneCycle`` and ``LRRangeTest`` are named
in ``VALID_LR_SCHEDULES``, as DeepSpeed names them, and raise :class:`DeepSpeedAPIError` when asked for."""
from __future__ import annotations

from zeropp.deepspeed.missing import module_getattr
from zeropp.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LR_RANGE_TEST", "ONE_CYCLE",
           "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR"]


__getattr__ = module_getattr("deepspeed.runtime.lr_schedules")
