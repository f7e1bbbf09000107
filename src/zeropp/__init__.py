"""zeropp: ZeRO stage 3 with the ZeRO++ communication techniques (qwZ, hpZ, qgZ) on PyTorch.

    engine, optimizer, _, scheduler = zeropp.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

DeepSpeed's script-level API is here too, so ``import zeropp as deepspeed`` runs DeepSpeed training scripts:
``initialize`` (DeepSpeed's arguments), ``add_config_arguments``, ``init_distributed``, ``zero.Init``,
``zero.GatheredParameters``, ``zero.register_external_parameter``, ``checkpointing.checkpoint``, ``utils``
(``safe_get_full_fp32_param`` & co.) and ``runtime.zero``; they live in ``zeropp/deepspeed/``. For code that
imports ``deepspeed`` itself, ``zeropp.install_deepspeed_alias()`` registers that package under that name. A
DeepSpeed name zeropp lacks raises an error that names it. ``zeropp.api.build(model, config=...)`` is the
native, keyword-only entry point (the engine without DeepSpeed's accessors).
"""
from typing import Any

from zeropp import zero
from zeropp._version import __version__
from zeropp.deepspeed import checkpointing
from zeropp.deepspeed.alias import install_deepspeed_alias, uninstall_deepspeed_alias
from zeropp.deepspeed.missing import module_getattr
from zeropp.deepspeed.module_api import InitResult, add_config_arguments, init_distributed, initialize

__all__ = ["initialize", "InitResult", "add_config_arguments", "init_distributed", "zero", "checkpointing",
           "install_deepspeed_alias", "uninstall_deepspeed_alias"]


def __getattr__(name: str) -> Any:
    if name in ("utils", "runtime"):  # DeepSpeed's subpackages, for `import zeropp as deepspeed` scripts
        import importlib
        return importlib.import_module(f"zeropp.deepspeed.{name}")
    if name in ("DeepSpeedConfig", "DeepSpeedConfigError"):  # DeepSpeed's top-level config names
        from zeropp.deepspeed.runtime import config
        return getattr(config, name)
    return _deepspeed_getattr(name)


_deepspeed_getattr = module_getattr("deepspeed", module="zeropp")  # a DeepSpeed name zeropp lacks: an error naming it
