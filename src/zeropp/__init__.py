"""zeropp: ZeRO stage 3 with the ZeRO++ communication techniques (qwZ, hpZ, qgZ) on PyTorch.

    engine, optimizer, _, scheduler = zeropp.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()
"""
from zeropp.api import InitResult, initialize

__all__ = ["initialize", "InitResult"]
__version__ = "0.1.0"
