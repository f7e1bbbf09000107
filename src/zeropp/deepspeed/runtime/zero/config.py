"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, the ``zero_optimization`` section as an object."""
from __future__ import annotations

from typing import Any

from zeropp.config.loader import parse_config
from zeropp.config.schema import ZeroConfig


def DeepSpeedZeroConfig(**zero_optimization: Any) -> ZeroConfig:  # noqa: N802 (DeepSpeed's class name)
    """The ``zero_optimization`` section validated as zeropp reads it (DeepSpeed's key names, deprecated flags
    translated): zeropp's frozen ``ZeroConfig``, whose fields carry DeepSpeed's names. Errors are
    ``zeropp.config.ConfigError`` naming the key."""
    return parse_config({"zero_optimization": zero_optimization}).zero_optimization


__all__ = ["DeepSpeedZeroConfig"]
