"""zeropp's DeepSpeed layer: every DeepSpeed name zeropp provides, in DeepSpeed's own module tree.

This package is what ``zeropp.install_deepspeed_alias()`` registers as ``deepspeed`` (``alias.py``): a name lives
here at its DeepSpeed path (``runtime/engine.py``'s ``DeepSpeedEngine``, ``utils/``'s ``safe_get_full_*``,
``runtime/zero/``'s ZeRO optimizer views, ``checkpointing.py``, ``comm.py``), over zeropp's core, which keeps its
own vocabulary. Names DeepSpeed has and zeropp lacks are listed once, in ``missing.py``, and raise
:class:`DeepSpeedAPIError` naming them. DeepSpeed checkpoints are read and written by ``checkpoint_format.py`` and
``checkpoint_io.py``; ``params.py`` gives partitioned parameters DeepSpeed's ``ds_*`` attributes as views while
the alias is installed.

``__version__`` is the DeepSpeed release whose API this layer follows (integrations compare it);
``__zeropp_version__`` is zeropp's own.
"""
import inspect
from typing import Any

import torch

from zeropp._version import __version__ as __zeropp_version__
from zeropp.deepspeed import accelerator, checkpoint, checkpointing, comm, ops, runtime, utils, zero
from zeropp.deepspeed.accelerator import get_accelerator
from zeropp.deepspeed.missing import DeepSpeedAPIError, module_getattr
from zeropp.deepspeed.module_api import InitResult, add_config_arguments, init_distributed
from zeropp.deepspeed.module_api import initialize as _initialize
from zeropp.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from zeropp.deepspeed.runtime.engine import DeepSpeedEngine
from zeropp.deepspeed.runtime.lr_schedules import add_tuning_arguments

__version__ = "0.19.8"
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in __version__.split("."))
# the DeepSpeed build these would name: none (DeepSpeed's own release wheels report "unknown" too)
__git_hash__ = "unknown"
__git_branch__ = "unknown"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "add_tuning_arguments", "zero", "checkpointing",
           "utils", "runtime", "comm", "ops", "accelerator", "checkpoint", "get_accelerator", "DeepSpeedEngine",
           "DeepSpeedAPIError", "DeepSpeedConfig", "DeepSpeedConfigError", "__zeropp_version__"]


def initialize(*args: Any, **kwargs: Any) -> InitResult:
    """``zeropp.initialize`` (same arguments), returning a :class:`DeepSpeedEngine` and, as its optimizer,
    ``engine.optimizer``, what DeepSpeed's engine holds: the view of its ZeRO optimizer at stages 1-3
    (``runtime/zero/zero_optimizer.py``: ``optimizer.optimizer`` is the client's optimizer object,
    ``fp16_groups``, ...), at stage 0 the torch optimizer itself in fp32 and DeepSpeed's unfused 16-bit wrapper in
    fp16/bf16; None at stage 0 in fp32 or fp16 when neither the arguments nor the config give an optimizer,
    as in DeepSpeed."""
    given = inspect.signature(_initialize).bind(*args, **kwargs).arguments
    scheduler, optimizer = given.get("lr_scheduler"), given.get("optimizer")
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(optimizer, torch.optim.Optimizer):
        # DeepSpeed's check: a scheduler object is built over an optimizer object, which must be the one given
        raise AssertionError(f"Client Optimizer (type = {type(optimizer)} is not instantiated but Client LR Scheduler "
                             "is instantiated")
    result = _initialize(*args, engine_class=DeepSpeedEngine, **kwargs)
    return result._replace(optimizer=result.engine.optimizer)


initialize.__wrapped__ = _initialize  # type: ignore[attr-defined]


__getattr__ = module_getattr("deepspeed")
