"""``deepspeed.checkpoint``: the checkpoint helpers integrations call (``utils.clone_tensors_for_torch_save``), the key
names of DeepSpeed's checkpoint files (``constants``, also here: ``UNIVERSAL_CHECKPOINT_INFO`` ...), and universal
checkpoints: ``ds_to_universal`` (DeepSpeed's converter, over zeropp's) and ``universal_io`` (DeepSpeed's universal
layout read and written without DeepSpeed). DeepSpeed's ZeRO checkpoint files themselves are read and written by
``zeropp/deepspeed/checkpoint_format.py`` and ``checkpoint_io.py``. DeepSpeed's checkpoint readers and reshapers
(``DeepSpeedCheckpoint``, ``enable_universal_checkpoint``, ...) raise ``DeepSpeedAPIError`` naming them."""
from zeropp.deepspeed.checkpoint import constants, utils
from zeropp.deepspeed.checkpoint.constants import *  # noqa: F401,F403 - DeepSpeed's package exports them too
from zeropp.deepspeed.missing import module_getattr

__all__ = ["utils", "constants", *[n for n in dir(constants) if n.isupper()]]
__getattr__ = module_getattr("deepspeed.checkpoint")
