"""Training-step state machines for the ZeRO stages, and DeepSpeed's ``zero`` helpers: ``Init`` (build a
model with each module's parameters partitioned as it is built), ``GatheredParameters`` (full parameters outside the forward),
``register_external_parameter`` and ``TiledLinear`` (a huge Linear gathered one tile at a time)."""
from zeropp.partition.meta import UninitializedError
from zeropp.zero.gathered import GatheredParameters
from zeropp.zero.init_context import Init
from zeropp.zero.param_use import ParameterAccessError, register_external_parameter, unregister_external_parameter
from zeropp.zero.tiling import TiledLinear

__all__ = ["GatheredParameters", "Init", "ParameterAccessError", "TiledLinear", "UninitializedError",
           "register_external_parameter", "unregister_external_parameter"]
