"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (zeropp's CPU Adam, ``zeropp/offload/cpu_adam.py``, under
DeepSpeed's name and signature). ``FusedAdam`` is not provided."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from zeropp.deepspeed.missing import DeepSpeedAPIError, module_getattr
from zeropp.offload.cpu_adam import CpuAdam

__all__ = ["DeepSpeedCPUAdam"]


class DeepSpeedCPUAdam(CpuAdam):
    """Adam(W) on the host, as DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps,
    weight_decay, amsgrad, adamw_mode, fp32_optimizer_states)``. zeropp's kernel always corrects the bias and keeps
    fp32 moments; ``bias_correction=False``, ``amsgrad=True`` and ``fp32_optimizer_states=False`` raise.
    ``decoupled_weight_decay`` (torch's name, kept in the groups) overrides ``adamw_mode`` when given."""

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True, decoupled_weight_decay: Optional[bool] = None) -> None:
        for name, given, built in (("bias_correction", bias_correction, True), ("amsgrad", amsgrad, False),
                                   ("fp32_optimizer_states", fp32_optimizer_states, True)):
            if given != built:
                raise DeepSpeedAPIError(f"DeepSpeedCPUAdam({name}={given!r}) is not implemented by zeropp; "
                                        f"leave {name} at {built!r}")
        adamw = adamw_mode if decoupled_weight_decay is None else decoupled_weight_decay
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw)


__getattr__ = module_getattr("deepspeed.ops.adam")
