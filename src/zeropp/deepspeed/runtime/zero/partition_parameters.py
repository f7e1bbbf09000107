"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``, and
the constructor-wrapping names that code written for DeepSpeed replaces around ``zero.Init``."""
import enum
from typing import Any, Callable, Optional

import torch

from zeropp.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter


class ZeroParamStatus(enum.Enum):
    """Whether a ZeRO-3 parameter's full values are on this rank (DeepSpeed's values)."""

    AVAILABLE = 1  # gathered: the full values are there
    NOT_AVAILABLE = 2  # partitioned: this rank holds its chunk only
    INFLIGHT = 3  # a gather has been started and not yet waited for


# DeepSpeed's shape of a partitioned parameter's data (an empty [0]), for code that imports it. zeropp keeps a
# partitioned parameter's shape (its storage is what is empty), so compare ``param.ds_status`` with
# ``ZeroParamStatus.NOT_AVAILABLE`` to ask whether one is partitioned.
partitioned_param_data_shape = [0]

_orig_torch_arange = torch.arange  # DeepSpeed's name for the unwrapped constructor


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: Optional[torch.dtype],
                                           target_device: Optional[torch.device] = None) -> Callable:
    """DeepSpeed's wrapper of a tensor constructor: the tensor made on ``target_device`` when no device is given,
    floating-point results cast to ``target_fp_dtype``.

    DeepSpeed's ``zero.Init`` puts it around ``torch.arange``, ``torch.empty`` & co. for the whole context, so that
    buffers come out in the training dtype too. zeropp's ``Init`` wraps no constructor (it casts the parameters as
    it partitions them and leaves every other tensor as the module's code makes it), so replacing this function
    around ``zero.Init``, as transformers' ``prevent_arange_dtype_change`` does, changes nothing."""
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if target_fp_dtype is not None and tensor.is_floating_point() else tensor
    return wrapped


__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "partitioned_param_data_shape", "zero_wrapper_for_fp_tensor_constructor"]
