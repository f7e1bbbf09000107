"""``deepspeed.runtime.fp16``: DeepSpeed's stage-0 16-bit optimizer wrappers (``unfused_optimizer``,
``fused_optimizer``), for the ``isinstance`` checks and attributes scripts read."""
from zeropp.deepspeed.runtime.fp16 import fused_optimizer, unfused_optimizer

__all__ = ["fused_optimizer", "unfused_optimizer"]
