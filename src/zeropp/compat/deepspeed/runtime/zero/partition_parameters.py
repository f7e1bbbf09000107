"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``."""
import enum

from zeropp.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter


class ZeroParamStatus(enum.Enum):
    """Whether a ZeRO-3 parameter's full values are on this rank (DeepSpeed's values)."""

    AVAILABLE = 1  # gathered: the full values are there
    NOT_AVAILABLE = 2  # partitioned: this rank holds its chunk only
    INFLIGHT = 3  # a gather has been started and not yet waited for


__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus"]
