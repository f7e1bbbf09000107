"""``deepspeed.checkpointing`` (DeepSpeed's ``runtime/activation_checkpointing/checkpointing.py``) over zeropp's
activation checkpointing (``zeropp/activation/checkpointing.py``): ``checkpoint``, ``configure``,
``is_configured`` and ``reset`` as DeepSpeed's scripts call them; the rest of the core module's functions
(``settings``, ``timings``, ``set_link``, ``gradient_checkpointing_enable``, ...) are here too. Megatron-style
model parallelism's helpers raise :class:`DeepSpeedAPIError` naming them."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from zeropp.activation import checkpointing as core
from zeropp.activation.checkpointing import (Settings, apply_config, attach, buffer_bytes,
                                             gradient_checkpointing_enable, is_configured, reset, set_link,
                                             settings, settings_from, timings)
from zeropp.deepspeed.missing import DeepSpeedAPIError, module_getattr
from zeropp.errors import NotBuiltError

__all__ = ["checkpoint", "configure", "is_configured", "reset", "apply_config", "set_link", "timings", "settings",
           "gradient_checkpointing_enable", "attach", "buffer_bytes", "Settings"]


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool | str] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``checkpointing.configure``: the settings of ``deepspeed_config`` (a path, dict or
    ``ZeroppConfig``: its ``activation_checkpointing`` section; defaults without one), overridden by the
    keyword arguments. Each call starts from the defaults, as DeepSpeed's does.

    Raises :class:`DeepSpeedAPIError` for ``mpu_`` (model parallelism) and for the combinations
    ``zeropp.activation.checkpointing.use`` refuses.
    """
    if mpu_ is not None:
        raise DeepSpeedAPIError("checkpointing.configure(mpu_=...): model parallelism is not implemented by "
                                "zeropp; zeropp partitions over data-parallel ranks only")
    s = settings_from(deepspeed_config)
    with _named():
        core.use(Settings(
            partition_activations=_pick(partition_activations, s.partition_activations),
            cpu_checkpointing=_pick(checkpoint_in_cpu, s.cpu_checkpointing),
            contiguous_memory_optimization=_pick(contiguous_checkpointing, s.contiguous_memory_optimization),
            number_checkpoints=_pick(num_checkpoints, s.number_checkpoints),
            synchronize_checkpoint_boundary=_pick(synchronize, s.synchronize_checkpoint_boundary),
            profile=_pick(profile, s.profile),
        ))


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its arguments for backward and running it again there
    (``zeropp.activation.checkpointing.checkpoint``, with the settings :func:`configure` put in force)."""
    with _named():
        return core.checkpoint(function, *args, **kwargs)


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


__getattr__ = module_getattr("deepspeed.checkpointing")
