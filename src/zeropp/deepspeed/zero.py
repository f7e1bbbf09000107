"""``deepspeed.zero``: DeepSpeed's name for ``deepspeed.runtime.zero``."""
from zeropp.deepspeed.runtime.zero import *  # noqa: F401,F403
from zeropp.deepspeed.runtime.zero import __all__  # noqa: F401
