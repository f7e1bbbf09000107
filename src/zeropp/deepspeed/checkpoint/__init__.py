"""``deepspeed.checkpoint``: the checkpoint helpers integrations call (``utils.clone_tensors_for_torch_save``).
DeepSpeed's ZeRO checkpoint files themselves are read and written by ``zeropp/deepspeed/checkpoint_format.py``
and ``checkpoint_io.py``."""
from zeropp.deepspeed.checkpoint import utils

__all__ = ["utils"]
