"""``deepspeed.runtime.zero.stage3``: names scripts import from DeepSpeed's ZeRO-3 module."""
import contextlib
from typing import Any, Iterator

from zeropp.deepspeed.runtime.zero.zero_optimizer import DeepSpeedZeroOptimizer_Stage3
from zeropp.deepspeed.missing import DeepSpeedAPIError


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Gather every parameter of the engine ``model`` once and keep them gathered for the block, so that
    ``generate()`` does not gather every unit for every token (``ZeroEngine.held_whole``); yields ``model``.
    Every rank enters the block. The weights are for reading inside it."""
    held = getattr(model, "held_whole", None)
    if held is None:
        raise DeepSpeedAPIError(f"unwrap_model_for_generation takes the engine deepspeed.initialize returned, got "
                                f"a {type(model).__name__}")
    with held():
        yield model


__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]
