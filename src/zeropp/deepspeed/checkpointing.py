"""``deepspeed.checkpointing``: DeepSpeed's short name of ``deepspeed.runtime.activation_checkpointing.checkpointing``.
Importing this module gives that one (the same module object under both names, as in DeepSpeed), so a setting
written through one name is read through the other."""
import sys

from zeropp.deepspeed.runtime.activation_checkpointing import checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
