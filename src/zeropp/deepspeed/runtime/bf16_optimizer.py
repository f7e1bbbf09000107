"""``deepspeed.runtime.bf16_optimizer``: DeepSpeed's bf16 optimizer of stages 0-1 is not a separate class in zeropp
(bf16 runs through its ZeRO optimizer at every stage: ``engine.optimizer``); its names raise ``DeepSpeedAPIError``."""
from zeropp.deepspeed.missing import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.bf16_optimizer")
