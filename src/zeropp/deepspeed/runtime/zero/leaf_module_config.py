"""``deepspeed.runtime.zero.leaf_module_config``: the default leaf modules of ``zero_optimization.leaf_module``
(DeepSpeed's constant names over zeropp's ``config_models.DEFAULT_LEAF_CLASSES``)."""
from zeropp.config.schema import DEFAULT_LEAF_CLASSES

DEFAULT_LEAF_MODULE_CLASSES = list(DEFAULT_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list = []

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
