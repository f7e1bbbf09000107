"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing``, the module DeepSpeed also names
``deepspeed.checkpointing`` (one module object under both names)."""
from zeropp.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
