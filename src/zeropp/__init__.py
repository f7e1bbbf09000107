"""zeropp: ZeRO stage 3 with the ZeRO++ communication techniques (qwZ, hpZ, qgZ) on PyTorch.

    engine, optimizer, _, scheduler = zeropp.initialize(model=model, config="ds_config.json")
    loss = engine(batch); engine.backward(loss); engine.step()

DeepSpeed's script-level API is here too, so ``import zeropp as deepspeed`` runs DeepSpeed training scripts:
``initialize`` (DeepSpeed's arguments), ``add_config_arguments``, ``init_distributed``, ``zero.Init``,
``zero.GatheredParameters``, ``zero.register_external_parameter``, ``checkpointing.checkpoint``, ``utils``
(``safe_get_full_fp32_param`` & co.) and ``runtime.zero``. For code that imports ``deepspeed`` itself,
``zeropp.install_deepspeed_alias()`` registers the same API under that name. A DeepSpeed name zeropp
lacks raises an error that names it.
"""
from typing import Any

from zeropp import checkpointing, zero
from zeropp._version import __version__
from zeropp.api import InitResult, initialize
from zeropp.deepspeed_api import MISSING_MODULE_API, add_config_arguments, init_distributed, missing

__all__ = ["initialize", "InitResult", "add_config_arguments", "init_distributed", "zero", "checkpointing",
           "install_deepspeed_alias"]


def install_deepspeed_alias() -> None:
    """Register zeropp's DeepSpeed API as the ``deepspeed`` package (``zeropp.compat``)."""
    from zeropp.compat import install_deepspeed_alias as install
    install()


def __getattr__(name: str) -> Any:
    if name in ("utils", "runtime"):  # DeepSpeed's subpackages, for `import zeropp as deepspeed` scripts
        import importlib
        return importlib.import_module(f"zeropp.compat.deepspeed.{name}")
    if name in MISSING_MODULE_API:
        raise missing(name)
    raise AttributeError(f"module 'zeropp' has no attribute {name!r}")
