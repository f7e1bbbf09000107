"""Activation checkpointing with DeepSpeed's names: ``zeropp.checkpointing.checkpoint(fn, *args)``.

A checkpointed function keeps only its inputs through the forward pass and runs again during backward to
rebuild its activations. Under stage 3 the rerun needs its weights again: the engine gathers them like any
backward gather (from hpZ's secondary shards when hpZ is on, so no byte crosses nodes), and a weight the
rerun reads is served on demand like every read outside its module's forward (Note [external reads]).

The rerun uses torch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``), which preserves the RNG state (dropout draws the same mask twice) and works with
inputs that do not require gradients. ``torch.utils.checkpoint`` itself and Hugging Face's
``model.gradient_checkpointing_enable()`` work with every stage as well; this module exists so that a
DeepSpeed script's ``deepspeed.checkpointing.checkpoint`` runs unchanged.

``configure`` takes DeepSpeed's arguments. The settings that change where checkpoints live
(``partition_activations``, ``checkpoint_in_cpu``, ``contiguous_checkpointing``) are not built yet and raise
an error naming them, rather than being silently ignored; the rest change nothing here (see
docs/config.md, activation_checkpointing).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.utils.checkpoint as torch_checkpoint

from zeropp.zero.deepspeed_surface import DeepSpeedAPIError

__all__ = ["checkpoint", "configure", "is_configured", "reset"]


_configured = False  # DeepSpeed's is_configured(); the settings that change nothing here are not kept
_NOT_BUILT = {
    "partition_activations": "split each saved checkpoint across ranks",
    "checkpoint_in_cpu": "keep saved checkpoints on the host",
    "contiguous_checkpointing": "copy checkpoints into one preallocated buffer",
}


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, keeping only ``args`` for backward and running ``function`` again there."""
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``checkpointing.configure``: settings from ``deepspeed_config`` (a path, dict or
    ``ZeroppConfig``: its ``activation_checkpointing`` section), overridden by the keyword arguments.

    Raises :class:`~zeropp.zero.deepspeed_surface.DeepSpeedAPIError` for ``mpu_`` (model parallelism) and for
    the settings not built yet, naming each one.
    """
    if mpu_ is not None:
        raise DeepSpeedAPIError("checkpointing.configure(mpu_=...): model parallelism is not implemented by "
                                "zeropp; zeropp partitions over data-parallel ranks only")
    section: dict[str, Any] = {}
    if deepspeed_config is not None:
        from zeropp.config import load_config  # the config layer is below; imported here to keep import light
        section = load_config(deepspeed_config).activation_checkpointing.model_dump()
    asked = {
        "partition_activations": _pick(partition_activations, section.get("partition_activations")),
        "checkpoint_in_cpu": _pick(checkpoint_in_cpu, section.get("cpu_checkpointing")),
        "contiguous_checkpointing": _pick(contiguous_checkpointing,
                                          section.get("contiguous_memory_optimization")),
    }
    on = [name for name, value in asked.items() if value]
    if on:
        raise DeepSpeedAPIError("checkpointing.configure: not implemented by zeropp yet: " + "; ".join(
            f"{name}=True ({_NOT_BUILT[name]})" for name in on))
    global _configured
    _configured = True  # num_checkpoints, synchronize and profile tune buffers and timers zeropp does not keep


def is_configured() -> bool:
    """True once :func:`configure` ran (DeepSpeed's check before using the module)."""
    return _configured


def reset() -> None:
    """Forget the settings (DeepSpeed resets its buffers between iterations; zeropp keeps none)."""
    global _configured
    _configured = False


def _pick(argument: Any, from_config: Any) -> Any:
    return argument if argument is not None else from_config


def __getattr__(name: str) -> Any:
    # DeepSpeed's model-parallel RNG helpers belong to Megatron-style model parallelism
    if name in ("model_parallel_cuda_manual_seed", "get_cuda_rng_tracker", "CheckpointFunction",
                "non_reentrant_checkpoint", "partition_activations_in_checkpoint", "set_num_layers"):
        raise DeepSpeedAPIError(f"DeepSpeed's deepspeed.checkpointing.{name} is not implemented by zeropp yet")
    raise AttributeError(f"module 'zeropp.checkpointing' has no attribute {name!r}")
