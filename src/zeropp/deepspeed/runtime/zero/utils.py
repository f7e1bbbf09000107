"""``deepspeed.runtime.zero.utils``: the exception DeepSpeed's ZeRO raises for settings it refuses, for scripts
that catch it. zeropp raises its own errors (ConfigError, DeepSpeedAPIError), which name the setting."""


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO configuration error."""
