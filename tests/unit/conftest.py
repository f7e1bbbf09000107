"""Fixtures shared by the unit tests."""
from __future__ import annotations

from typing import Iterator

import pytest

import zeropp
from zeropp.deepspeed.alias import uninstall_deepspeed_alias


@pytest.fixture
def alias() -> Iterator[None]:
    """zeropp's DeepSpeed API registered as ``deepspeed`` for the test, and taken away after it."""
    zeropp.install_deepspeed_alias()
    try:
        yield
    finally:
        uninstall_deepspeed_alias()
