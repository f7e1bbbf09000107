"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a checkpoint, zeropp's or DeepSpeed's, without a
process group (``zeropp.checkpoint`` reads both formats, nothing unpickled beyond DeepSpeed's allowlist)."""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from zeropp.checkpoint.consolidate import load_full_checkpoint, write_state_dict
from zeropp.deepspeed import checkpoint_format
from zeropp.deepspeed.missing import DeepSpeedAPIError

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's full fp32 state dict (tag ``tag``, default: what ``latest`` names): of a zeropp
    checkpoint, or of a DeepSpeed ZeRO checkpoint (what DeepSpeed's ``zero_to_fp32`` gives: the fp32 masters,
    tied aliases, frozen parameters and buffers)."""
    if exclude_frozen_parameters or lazy_mode:
        raise DeepSpeedAPIError("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=..., "
                                "lazy_mode=...) "
                                "is not implemented by zeropp yet")
    ds_tag = checkpoint_format.deepspeed_tag_dir(checkpoint_dir, tag)
    if ds_tag is None:
        return load_full_checkpoint(checkpoint_dir, tag).state_dict
    ds = checkpoint_format.read(ds_tag)
    state = {**ds.params, **ds.frozen}
    state.update({alias: state[name] for alias, name in ds.shared.items() if name in state})
    state.update({k: (v.float() if v.is_floating_point() else v) for k, v in ds.buffers.items()})
    return state


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (moved to the host, as DeepSpeed does) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, tag: Optional[str] = None,
                                               safe_serialization: bool = False, **_: object) -> str:
    """Write the checkpoint's fp32 state dict to ``output_dir`` (``model.safetensors`` with
    ``safe_serialization``, else ``pytorch_model.bin``); returns the file written."""
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    os.makedirs(output_dir, exist_ok=True)
    return write_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag),
                            os.path.join(output_dir, name))
