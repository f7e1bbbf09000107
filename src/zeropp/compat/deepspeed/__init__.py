"""``deepspeed``, as zeropp provides it (``zeropp.compat.install_deepspeed_alias`` registers this package under
that name): ``initialize``, ``init_distributed``, ``add_config_arguments``, ``zero``, ``checkpointing``, ``utils``,
``runtime`` and ``comm``. Names below DeepSpeed's that zeropp lacks raise :class:`DeepSpeedAPIError` naming them.

``__version__`` is the DeepSpeed release whose API this layer follows (integrations compare it);
``__zeropp_version__`` is zeropp's own.
"""
from typing import Any

from zeropp import checkpointing
from zeropp._version import __version__ as __zeropp_version__
from zeropp.api import InitResult
from zeropp.api import initialize as _initialize
from zeropp.compat.deepspeed import comm, runtime, utils, zero
from zeropp.compat.deepspeed.runtime.engine import DeepSpeedEngine, as_deepspeed_engine
from zeropp.deepspeed_api import MISSING_MODULE_API, add_config_arguments, init_distributed, missing

__version__ = "0.19.8"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "checkpointing", "utils", "runtime",
           "comm", "DeepSpeedEngine", "__zeropp_version__"]


def initialize(*args: Any, **kwargs: Any) -> InitResult:
    """``zeropp.initialize`` (same arguments), returning a :class:`DeepSpeedEngine` and, as its optimizer, the view
    of DeepSpeed's ZeRO optimizer (``runtime/zero/zero_optimizer.py``) that is also ``engine.optimizer``:
    ``optimizer.optimizer.state[...]``, ``fp16_groups``, ... as DeepSpeed's scripts read them."""
    result = _initialize(*args, **kwargs)
    engine = as_deepspeed_engine(result.engine)
    return result._replace(engine=engine, optimizer=engine.optimizer)


initialize.__wrapped__ = _initialize  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    if name in MISSING_MODULE_API:
        raise missing(name)
    raise AttributeError(f"module 'deepspeed' (zeropp's DeepSpeed API) has no attribute {name!r}")
