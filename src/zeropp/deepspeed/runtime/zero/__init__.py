"""``deepspeed.runtime.zero``: building big models and reaching their full parameters (zeropp's ``zero.Init`` and
``GatheredParameters``), memory-centric tiling (``TiledLinear``), and the status enum integrations read."""
from zeropp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zeropp.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from zeropp.zero import (GatheredParameters, Init, TiledLinear, register_external_parameter,
                         unregister_external_parameter)

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "TiledLinear", "unwrap_model_for_generation"]
