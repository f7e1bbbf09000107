"""``deepspeed.accelerator``: ``get_accelerator()``, the device zeropp computes on, with the methods integrations
call (``device_name``, ``current_device_name``, ``communication_backend_name``, ``is_available``,
``device_count``, ``current_device``, ``synchronize``). Another DeepSpeed accelerator method raises
:class:`DeepSpeedAPIError` naming it."""
from __future__ import annotations

from typing import Any, Optional

import torch

from zeropp.deepspeed.missing import DeepSpeedAPIError

__all__ = ["get_accelerator"]


class _Accelerator:
    """CUDA where torch sees a GPU, else the host (DeepSpeed's ``cuda`` and ``cpu`` accelerators)."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"``, ``"cuda:<index>"`` or ``"cpu"``, as DeepSpeed spells them."""
        if self._name == "cuda" and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise DeepSpeedAPIError(f"DeepSpeed's get_accelerator().{name} is not implemented by zeropp yet; it "
                                "offers device_name, current_device_name, current_device, device_count, "
                                "is_available, communication_backend_name and synchronize")


_ACCELERATOR: Optional[_Accelerator] = None


def get_accelerator() -> _Accelerator:
    """The accelerator of this process (one per process, as DeepSpeed's)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _Accelerator()
    return _ACCELERATOR
