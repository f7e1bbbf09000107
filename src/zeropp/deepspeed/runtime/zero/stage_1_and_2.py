"""``deepspeed.runtime.zero.stage_1_and_2``: the class of the optimizer ``deepspeed.initialize`` returns at
stages 0-2, for scripts that check it with ``isinstance``."""
from zeropp.deepspeed.runtime.zero.zero_optimizer import DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
