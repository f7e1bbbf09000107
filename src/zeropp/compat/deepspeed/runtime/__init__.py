"""``deepspeed.runtime``: the ``zero`` subpackage."""
from zeropp.compat.deepspeed.runtime import zero

__all__ = ["zero"]
