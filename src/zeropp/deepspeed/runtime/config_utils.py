"""``deepspeed.runtime.config_utils``: the config error types and the forms a config comes in, shared by
``runtime/config.py`` (``DeepSpeedConfig``) and ``runtime/zero/config.py`` (``DeepSpeedZeroConfig``)."""
from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
from typing import Any, Iterator

from zeropp.config.loader import ConfigError, NotSupportedError
from zeropp.config.relaxed_json import loads_config

__all__ = ["DeepSpeedConfigError", "DeepSpeedNotSupportedError", "deepspeed_config_errors", "decoded_config"]


class DeepSpeedConfigError(ConfigError):
    """DeepSpeed's config error (``deepspeed.DeepSpeedConfigError``): zeropp's :class:`ConfigError` under DeepSpeed's
    name, each problem one line naming its JSON path."""


class DeepSpeedNotSupportedError(DeepSpeedConfigError, NotSupportedError):
    """A valid DeepSpeed setting zeropp does not have yet, raised as :class:`DeepSpeedConfigError`."""


@contextlib.contextmanager
def deepspeed_config_errors() -> Iterator[None]:
    """Raise zeropp's config errors inside the block as :class:`DeepSpeedConfigError` (the cause is the original)."""
    try:
        yield
    except DeepSpeedConfigError:
        raise
    except ConfigError as err:
        cls = DeepSpeedNotSupportedError if isinstance(err, NotSupportedError) else DeepSpeedConfigError
        raise cls(err.problems, err.source) from err


def decoded_config(config: Any) -> Any:
    """DeepSpeed's third form of a config: a string that is no file but a base64-encoded JSON (or Hjson) document,
    as a dict; any other value as it is."""
    if not isinstance(config, str) or os.path.exists(config):
        return config
    try:
        text = base64.urlsafe_b64decode(config.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return config  # not base64: the loader says the file is missing
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return loads_config(text, dict)
        except ValueError:
            return config
