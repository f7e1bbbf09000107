"""``deepspeed.runtime.activation_checkpointing.checkpointing``, which DeepSpeed also names ``deepspeed.checkpointing``
(``zeropp/deepspeed/checkpointing.py`` makes both names this one module), over zeropp's activation checkpointing
(``zeropp/activation/checkpointing.py``).

``checkpoint``, ``non_reentrant_checkpoint``, ``configure``, ``is_configured`` and ``reset`` as DeepSpeed's scripts
call them; the rest of the core module's functions (``settings``, ``timings``, ``set_link``,
``gradient_checkpointing_enable``, ...) are here too. zeropp's ``checkpoint`` is non-reentrant (torch's
``use_reentrant=False``), so ``non_reentrant_checkpoint`` is the same function with DeepSpeed's positional
signature: inputs that need no gradient work with either.

DeepSpeed keeps its settings in module globals (``PARTITION_ACTIVATIONS``, ``CONTIGUOUS_CHECKPOINTING``,
``num_layers``, ``CPU_CHECKPOINT``, ``SYNCHRONIZE``, ``PROFILE_TIME``, ``deepspeed_checkpointing_enabled``,
``mpu``), which its tests save and put back. Here they are views of the settings in force: reading one reads them,
assigning one changes that setting as given (without ``configure``'s checks; ``deepspeed_checkpointing_enabled =
False`` leaves the module unconfigured). Megatron-style model parallelism's helpers raise
:class:`DeepSpeedAPIError` naming them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from typing import Any, Callable, Iterator, Optional

from zeropp.activation import checkpointing as core
from zeropp.activation.checkpointing import (Settings, apply_config, attach, buffer_bytes,
                                             gradient_checkpointing_enable, is_configured, reset, set_link,
                                             settings, settings_from, timings)
from zeropp.deepspeed.missing import DeepSpeedAPIError, module_getattr
from zeropp.errors import NotBuiltError

__all__ = ["checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset", "apply_config",
           "set_link", "timings", "settings", "gradient_checkpointing_enable", "attach", "buffer_bytes", "Settings"]

NUM_LAYERS_NEEDED = "Must specify the number of layers with contiguous memory checkpointing"


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool | str] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``checkpointing.configure``: the settings of ``deepspeed_config`` (a path, dict or
    ``ZeroppConfig``: its ``activation_checkpointing`` section; defaults without one), overridden by the
    keyword arguments. Each call starts from the defaults, as DeepSpeed's does.

    Contiguous checkpointing without a number of checkpoints (``num_checkpoints``, or the section's
    ``number_checkpoints``) is DeepSpeed's ``AssertionError``; ``mpu_`` (model parallelism) and the combinations
    ``zeropp.activation.checkpointing.use`` refuses raise :class:`DeepSpeedAPIError`. A refused call changes
    nothing.
    """
    if mpu_ is not None:
        raise DeepSpeedAPIError("checkpointing.configure(mpu_=...): model parallelism is not implemented by "
                                "zeropp; zeropp partitions over data-parallel ranks only")
    s = settings_from(deepspeed_config)
    chosen = Settings(
        partition_activations=_pick(partition_activations, s.partition_activations),
        cpu_checkpointing=_pick(checkpoint_in_cpu, s.cpu_checkpointing),
        contiguous_memory_optimization=_pick(contiguous_checkpointing, s.contiguous_memory_optimization),
        number_checkpoints=_pick(num_checkpoints, s.number_checkpoints),
        synchronize_checkpoint_boundary=_pick(synchronize, s.synchronize_checkpoint_boundary),
        profile=_pick(profile, s.profile),
    )
    if chosen.contiguous_memory_optimization and chosen.number_checkpoints is None:
        raise AssertionError(f"{NUM_LAYERS_NEEDED} (configure(num_checkpoints=...), or the activation_checkpointing "
                             "section's number_checkpoints: the count sizes the contiguous buffer)")
    with _named():
        core.use(chosen)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its arguments for backward and running it again there
    (``zeropp.activation.checkpointing.checkpoint``, with the settings :func:`configure` put in force)."""
    with _named():
        return core.checkpoint(function, *args, **kwargs)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's non-reentrant checkpoint (inputs without gradients, partial graphs): :func:`checkpoint`, which
    is non-reentrant already."""
    return checkpoint(function, *args)


@contextlib.contextmanager
def _named() -> Iterator[None]:
    """A setting zeropp does not build, raised under DeepSpeed's error type (the core's is its base class)."""
    try:
        yield
    except DeepSpeedAPIError:
        raise
    except NotBuiltError as err:
        raise DeepSpeedAPIError(str(err)) from err


def _pick(argument: Any, from_config: Any) -> Any:
    return argument if argument is not None else from_config


# DeepSpeed's module globals -> the field of the settings each one views
_GLOBALS = {"PARTITION_ACTIVATIONS": "partition_activations",
            "CONTIGUOUS_CHECKPOINTING": "contiguous_memory_optimization", "num_layers": "number_checkpoints",
            "CPU_CHECKPOINT": "cpu_checkpointing", "SYNCHRONIZE": "synchronize_checkpoint_boundary",
            "PROFILE_TIME": "profile"}


class _CheckpointingModule(types.ModuleType):
    """This module, with DeepSpeed's globals as views of the settings in force (see the module docstring)."""

    def __getattr__(self, name: str) -> Any:
        if name in _GLOBALS:
            return getattr(settings(), _GLOBALS[name])
        if name == "deepspeed_checkpointing_enabled":
            return is_configured()
        if name == "mpu":
            return None  # no model parallelism
        return _missing(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _GLOBALS:
            core.restore(dataclasses.replace(settings(), **{_GLOBALS[name]: value}))
        elif name == "deepspeed_checkpointing_enabled":
            core.restore(settings() if value else None)
        elif name == "mpu":
            if value is not None:
                raise DeepSpeedAPIError("deepspeed.checkpointing.mpu: model parallelism is not implemented by zeropp")
        else:
            super().__setattr__(name, value)


_missing = module_getattr("deepspeed.checkpointing")
sys.modules[__name__].__class__ = _CheckpointingModule
