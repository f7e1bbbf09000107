"""``deepspeed.checkpointing`` (DeepSpeed's ``runtime/activation_checkpointing/checkpointing.py``) over zeropp's
activation checkpointing (``zeropp/activation/checkpointing.py``): ``checkpoint``, ``configure``,
``is_configured`` and ``reset`` as DeepSpeed's scripts call them; the rest of the core module's functions
(``settings``, ``timings``, ``set_link``, ``gradient_checkpointing_enable``, ...) are here too. Megatron-style
model parallelism's helpers raise :class:`DeepSpeedAPIError` naming them."""
from __future__ import annotations

from typing import Any, Optional

from zeropp.activation.checkpointing import (Settings, apply_config, attach, buffer_bytes, checkpoint,
                                             gradient_checkpointing_enable, is_configured, reset, set_link,
                                             settings, settings_from, timings, use)
from zeropp.deepspeed.missing import DeepSpeedAPIError, is_missing, missing

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
    use(Settings(
        partition_activations=_pick(partition_activations, s.partition_activations),
        cpu_checkpointing=_pick(checkpoint_in_cpu, s.cpu_checkpointing),
        contiguous_memory_optimization=_pick(contiguous_checkpointing, s.contiguous_memory_optimization),
        number_checkpoints=_pick(num_checkpoints, s.number_checkpoints),
        synchronize_checkpoint_boundary=_pick(synchronize, s.synchronize_checkpoint_boundary),
        profile=_pick(profile, s.profile),
    ))


def _pick(argument: Any, from_config: Any) -> Any:
    return argument if argument is not None else from_config


def __getattr__(name: str) -> Any:
    if is_missing("deepspeed.checkpointing", name):
        raise missing("deepspeed.checkpointing", name)
    raise AttributeError(f"module 'deepspeed.checkpointing' has no attribute {name!r}")
