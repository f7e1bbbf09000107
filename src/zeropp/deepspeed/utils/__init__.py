"""``deepspeed.utils``: full and local parameter, gradient and optimizer state of a parameter, and leaf modules.

Each ``safe_*`` function is DeepSpeed's, in its signature, over ``zeropp.zero.param_state`` (the engine's own
vocabulary): ``full`` values are collective (every rank calls; each gets the whole tensor, fp32), ``local`` ones
this rank's part of the flattened parameter (padding left out). A parameter no engine manages gives None from a
``get_full`` function, as in DeepSpeed; the ``local`` functions raise for it. Gradients are read between
``engine.backward`` and ``engine.step()``: averaged over the ranks, the fp16 loss scale taken out. A parameter
frozen at ``initialize`` has no trained fp32 value, gradient or optimizer state: the ``get`` functions give None
for it, as DeepSpeed's do, and the ``set`` ones refuse it (DeepSpeed ignores the write).

Leaf modules (``set_z3_leaf_modules`` & co.) make a module's whole subtree one ZeRO-3 gather unit; mark them
before ``initialize``, which plans the units (``zero_optimization.leaf_module`` does the same from the config).
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional, Type, Union

import torch
from torch import nn

from zeropp.partition.assign import is_leaf, mark_leaves, set_leaf
from zeropp.zero import param_state as ps

logger = logging.getLogger("deepspeed")

__all__ = [
    "logger", "log_dist", "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
    "safe_set_full_grad", "safe_update_full_grad_vectorized", "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_set_local_fp32_param", "safe_get_local_grad", "safe_set_local_grad",
    "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "set_z3_leaf_modules",
    "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "set_z3_leaf_module",
    "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
]


def log_dist(message: str, ranks: Optional[list[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks (all when None, DeepSpeed's ``[-1]`` too)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def _trained(param: torch.Tensor) -> Optional[ps.Located]:
    """Where a trained parameter's states live; None for one no engine manages or one frozen at initialize."""
    loc = ps.locate(param)
    return loc if loc is not None and loc.slot.trainable else None


def _managed(param: torch.Tensor, what: str) -> ps.Located:
    loc = ps.locate(param)
    if loc is None:
        raise ValueError(f"{what}: the parameter (shape {tuple(param.shape)}) is not managed by a zeropp engine; "
                         "the local API is defined for parameters after zeropp.initialize")
    return loc


def _local(param: torch.Tensor, what: str) -> Optional[ps.Located]:
    """This rank's part of a managed parameter (unmanaged: an error); None for one frozen at initialize."""
    loc = _managed(param, what)
    return loc if loc.slot.trainable else None


def _writable(param: torch.Tensor, what: str, local: bool = False) -> Optional[ps.Located]:
    """Where a write goes; a frozen parameter is refused by name (``local``: an unmanaged one too)."""
    loc = _managed(param, what) if local else ps.locate(param)
    if loc is not None and not loc.slot.trainable:
        raise ValueError(f"{what}: parameter {loc.slot.name!r} was frozen at initialize, so it has no fp32 master, "
                         "gradient or optimizer state to write; change a frozen weight inside "
                         "deepspeed.zero.GatheredParameters(param, modifier_rank=0)")
    return loc


# ---- full values (collective) ------------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's whole fp32 master; None for a parameter no engine manages or one frozen."""
    loc = _trained(param)
    return None if loc is None else ps.full_master(loc)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` the parameter's fp32 master (and weights); every rank passes the same value."""
    loc = _writable(param, "safe_set_full_fp32_param")
    if loc is not None:
        ps.set_master(loc, value)


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's whole gradient (fp32, averaged, unscaled), as the next step will use it."""
    loc = _trained(param)
    return None if loc is None else ps.full_grad(loc)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (unscaled) the gradient the next step uses."""
    loc = _writable(param, "safe_set_full_grad")
    if loc is not None:
        ps.set_grad(loc, value)


def safe_update_full_grad_vectorized(param_list: list[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """For each trained parameter of ``param_list`` with a gradient: make ``update_func(full_grad, param)`` its
    gradient (collective; frozen and unmanaged parameters are passed over, as in DeepSpeed)."""
    for param in param_list:
        loc = _trained(param)
        grad = None if loc is None else ps.full_grad(loc)
        if grad is not None:
            ps.set_grad(loc, update_func(grad, param))


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's whole optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    loc = _trained(param)
    return None if loc is None else ps.full_optimizer_state(loc, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Write the parameter's optimizer state ``optim_state_key``; every rank passes the same value."""
    loc = _writable(param, "safe_set_full_optimizer_state")
    if loc is not None:
        ps.set_optimizer_state(loc, optim_state_key, value)


# ---- this rank's part ----------------------------------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of the parameter's fp32 master; None for a frozen one."""
    loc = _local(param, "safe_get_local_fp32_param")
    return None if loc is None else ps.local_master(loc)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's part of the fp32 master (and weights)."""
    ps.set_master(_writable(param, "safe_set_local_fp32_param", local=True), value, local=True)


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of the reduced gradient (stages 2-3); None for a frozen parameter."""
    loc = _local(param, "safe_get_local_grad")
    return None if loc is None else ps.local_grad(loc)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's part of the reduced gradient (stages 2-3)."""
    ps.set_grad(_writable(param, "safe_set_local_grad", local=True), value, local=True)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's part of the optimizer state ``optim_state_key``; None for a frozen parameter."""
    loc = _local(param, "safe_get_local_optimizer_state")
    return None if loc is None else ps.local_optimizer_state(loc, optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's part of the optimizer state ``optim_state_key``."""
    ps.set_optimizer_state(_writable(param, "safe_set_local_optimizer_state", local=True), optim_state_key, value,
                           local=True)


# ---- leaf modules ------------------------------------------------------------------------------------------------
def _managed_warning(model: nn.Module) -> None:
    if any(ps.locate(p) is not None for p in model.parameters()):
        warnings.warn("leaf modules of a model zeropp.initialize already partitioned change nothing: its gather "
                      "units were planned then; mark them before initialize", stacklevel=3)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[Union[Type, str]],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of ``model`` of one of ``leaf_module_classes`` (types or class names) as a leaf."""
    if not all(isinstance(c, (type, str)) for c in leaf_module_classes):
        raise TypeError(f"leaf_module_classes must be a list of types or class names, got {leaf_module_classes}")
    _managed_warning(model)
    found = mark_leaves(model, classes=leaf_module_classes)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {type(model).__name__}")
    return found


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[Union[Type, str]],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Take the leaf mark off the modules of those classes."""
    found = mark_leaves(model, classes=leaf_module_classes, flag=False)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules named ``module_names`` (``named_modules()`` names); ``(modules, names not found)``."""
    _managed_warning(model)
    found = mark_leaves(model, names=module_names, flag=flag)
    names = {id(m): n for n, m in model.named_modules()}
    missing = [n for n in module_names if n not in {names[id(m)] for m in found}]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose names end with one of ``module_name_suffixes``; ``(modules, suffixes unmatched)``."""
    _managed_warning(model)
    found = mark_leaves(model, suffixes=module_name_suffixes, flag=flag)
    names = [n for n, m in model.named_modules() if any(m is f for f in found)]
    missing = [s for s in module_name_suffixes if not any(n.endswith(s) for n in names)]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules with suffixes {missing} found in model {type(model).__name__}")
    return found, missing


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked as leaves."""
    return [m for m in model.modules() if is_leaf(m)]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` itself is marked as a leaf."""
    return is_leaf(model)


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark or unmark ``model`` itself."""
    set_leaf(model, flag)
