"""The training config: DeepSpeed's JSON read into typed sections and settled once.

- ``schema.py``: the sections and their keys (pydantic models, each key with its doc and status);
- ``scheduler.py``: the ``scheduler`` section, DeepSpeed's five learning-rate schedules and their params;
- ``legacy.py``: DeepSpeed's older spellings, translated before validation;
- ``auto.py``: Hugging Face's ``"auto"`` values, filled from what is known;
- ``loader.py``: reading a file or dict into :class:`ZeroppConfig`, with every problem in one error;
- ``policy.py``: :func:`resolve`, the config plus the world and the model turned into the
  :class:`TrainPolicy` the engine is handed (every default and world-dependent check settled there, the
  gradient bucket size a model gets by default among them: Note [bucket size]).
"""
from zeropp.config.loader import (ConfigError, ConfigWarning, NotSupportedError, ZeroppConfig, load_config,
                                  parse_config, read_json)
from zeropp.config.schema import ZeroConfig

__all__ = ["ConfigError", "ConfigWarning", "NotSupportedError", "ZeroppConfig", "ZeroConfig", "load_config",
           "parse_config", "read_json"]
