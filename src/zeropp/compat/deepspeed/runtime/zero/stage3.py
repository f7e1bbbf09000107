"""``deepspeed.runtime.zero.stage3``: names scripts import from DeepSpeed's ZeRO-3 module."""
from typing import Any

from zeropp.zero.deepspeed_surface import DeepSpeedAPIError


def unwrap_model_for_generation(model: Any) -> Any:
    """Not implemented yet: gather every parameter once and take the engine's hooks off for ``generate()``."""
    raise DeepSpeedAPIError("DeepSpeed's deepspeed.runtime.zero.stage3.unwrap_model_for_generation is not implemented "
                            "by zeropp yet; call generate() on the engine's module directly (each module's weights "
                            "are gathered as it runs), or inside zeropp.zero.GatheredParameters(model.parameters())")


__all__ = ["unwrap_model_for_generation"]
