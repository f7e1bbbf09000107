"""Who wants to know when a parameter becomes partitioned (at construction or by an engine).

The compatibility layer gives DeepSpeed's ``ds_*`` attribute names to partitioned parameters while the
``deepspeed`` alias is installed (``zeropp/compat/deepspeed/params.py``); the layers below it know nothing of
DeepSpeed and only announce the event here.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

_LISTENERS: list[Callable[[nn.Parameter], None]] = []


def listen(fn: Callable[[nn.Parameter], None]) -> None:
    if fn not in _LISTENERS:
        _LISTENERS.append(fn)


def unlisten(fn: Callable[[nn.Parameter], None]) -> None:
    if fn in _LISTENERS:
        _LISTENERS.remove(fn)


def partitioned(param: nn.Parameter) -> None:
    """``param`` is partitioned from now on (each rank holds its chunk)."""
    for fn in list(_LISTENERS):
        fn(param)
