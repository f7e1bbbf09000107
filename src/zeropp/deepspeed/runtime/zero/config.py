"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, the ``zero_optimization`` section as an object."""
from __future__ import annotations

from typing import Any

from zeropp.config.loader import load_config
from zeropp.config.schema import ZeroConfig
from zeropp.deepspeed.runtime.config_utils import deepspeed_config_errors

ELASTIC_ZERO3 = ("ZeRO-3 elastic checkpointing is deprecated and no longer supported. Use Universal Checkpointing "
                 "instead.")


class DeepSpeedZeroConfig(ZeroConfig):
    """The ``zero_optimization`` section (keyword arguments in DeepSpeed's names, deprecated ones included),
    validated as ``initialize`` reads it: zeropp's frozen :class:`ZeroConfig`, with DeepSpeed's field names of the
    stage-3 keys as well (``gather_16bit_weights_on_model_save`` is true when either of its two config names,
    ``stage3_gather_16bit_weights_on_model_save`` or the older ``stage3_gather_fp16_weights_on_model_save``, is).

    Errors are :class:`~zeropp.deepspeed.runtime.config.DeepSpeedConfigError` naming the key. Stage 3 with
    ``elastic_checkpoint`` logs DeepSpeed's deprecation warning on the ``deepspeed`` logger (zeropp's checkpoints
    load on any world size anyway).
    """

    def __init__(self, **zero_optimization: Any) -> None:
        with deepspeed_config_errors():
            section = load_config({"zero_optimization": zero_optimization}).zero_optimization
        super().__init__(**section.model_dump())
        _warn_elastic(self)

    @classmethod
    def of(cls, section: ZeroConfig) -> "DeepSpeedZeroConfig":
        """The view of a section zeropp has validated already (``DeepSpeedConfig.zero_config``)."""
        out = cls.model_validate(section.model_dump())
        _warn_elastic(out)
        return out

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        return self.stage3_gather_16bit_weights_on_model_save or self.stage3_gather_fp16_weights_on_model_save

    @property
    def prefetch_bucket_size(self) -> int:
        return self.stage3_prefetch_bucket_size

    @property
    def param_persistence_threshold(self) -> int:
        return self.stage3_param_persistence_threshold

    @property
    def model_persistence_threshold(self) -> int:
        return self.stage3_model_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        return self.stage3_max_reuse_distance

    @property
    def module_granularity_threshold(self) -> int:
        return self.stage3_module_granularity_threshold


def _warn_elastic(section: ZeroConfig) -> None:
    if section.stage == 3 and section.elastic_checkpoint:
        from zeropp.deepspeed.utils import logger
        logger.warning(ELASTIC_ZERO3)


__all__ = ["DeepSpeedZeroConfig"]
