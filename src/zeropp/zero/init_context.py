"""``zero.Init``: DeepSpeed's context for building a model too large for one rank, on our meta construction.

Inside the context modules are created on the meta device (``torch.device("meta")`` as a context: a torch
function mode for the duration, no patching of torch). ``zeropp.initialize`` then materializes the model
one gather unit at a time on every rank, initializes each module with ``param_init_fn`` (default: the
model's own ``_init_weights`` for Hugging Face models, else each module's ``reset_parameters()``) and keeps
only this rank's chunk (docs/architecture.md, Partitioned construction).

Unlike DeepSpeed, initialization that a model's ``__init__`` does by hand (beyond ``reset_parameters`` or
``_init_weights``) acts on meta tensors and is not replayed: pass ``param_init_fn`` for such models.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zeropp.zero.deepspeed_surface import DeepSpeedAPIError


class Init:
    """``with zeropp.zero.Init(): model = MyModel()`` builds ``model`` without memory for its weights.

    DeepSpeed's arguments are accepted; ``config_dict_or_path``/``config``, ``dtype``, ``pin_memory``,
    ``remote_device`` and ``mem_efficient_linear`` are read at ``initialize`` from the config instead
    (the model is only built here); ``module=`` (an already built model) is partitioned by ``initialize``
    as it is. ``mpu`` and the parallel groups ask for model parallelism, which zeropp does not implement.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 sequence_data_parallel_group: Any = None, **kwargs: Any) -> None:
        for name, value in (("mpu", mpu), ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("data_parallel_group", data_parallel_group), *kwargs.items()):
            if value not in (None, False):
                raise DeepSpeedAPIError(f"zero.Init({name}=...) is not implemented by zeropp yet")
        self.enabled = enabled and module is None
        self._device: Optional[torch.device] = None

    def __enter__(self) -> "Init":
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            device, self._device = self._device, None
            device.__exit__(*exc)
