"""``deepspeed.checkpoint.utils``."""
from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank"]


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file of a tag folder for model-parallel rank ``mp_rank_str`` ("00"):
    ``<base_folder>/mp_rank_00_model_states.pt``."""
    return os.path.join(base_folder, "mp_rank_" + mp_rank_str + "_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """DeepSpeed's ZeRO optimizer-states file of a tag folder for a data-parallel and a model-parallel rank:
    ``<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp, 2 digits>_optim_states.pt``."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """``item`` (a tensor, or lists, tuples and dicts of them) with every tensor cloned onto ``device``, so that
    ``torch.save`` writes each tensor's own elements rather than the whole storage a view shares."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
