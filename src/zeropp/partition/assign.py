"""Which module gathers which parameter.

A parameter held by one module belongs to that module's unit. A parameter held by several modules (tied
weights, e.g. a token embedding reused as the output projection) belongs to their lowest common ancestor,
so it is gathered once per forward and once per backward and stays available to every user in between.

Granularity "block" then lifts every parameter inside a block (a child of an ``nn.ModuleList``, e.g. one
transformer layer) to that block: one gather per layer instead of one per Linear/LayerNorm, as FSDP2's
per-block ``fully_shard`` does. Fewer, larger collectives cost less on a busy CPU or a high-latency link;
the peak of gathered weights grows to one block. Granularity "module" keeps one unit per module. At either
granularity a leaf module (:func:`set_leaf`, DeepSpeed's ``set_z3_leaf_modules``) lifts its whole subtree.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Union

from torch import nn


@dataclass
class UnitPlan:
    """The module that gathers ``params`` (named by their first name in ``model.named_parameters()``)."""

    module_name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]


def _common_ancestor(names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    prefix: list[str] = []
    for level in zip(*parts):
        if all(x == level[0] for x in level):
            prefix.append(level[0])
        else:
            break
    return ".".join(prefix)


GRANULARITIES = ("module", "block")

# Modules whose whole subtree is one gather unit, whatever the granularity (DeepSpeed's "leaf modules": a
# mixture-of-experts block whose experts run on some ranks only, a module whose children run in an order that
# changes from call to call). Marked before initialize; a registry, nothing is set on the module.
_LEAVES: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def set_leaf(module: nn.Module, flag: bool = True) -> None:
    """Mark (or unmark) ``module`` as a leaf: its subtree is gathered as one unit."""
    if flag:
        _LEAVES[module] = True
    else:
        _LEAVES.pop(module, None)


def is_leaf(module: nn.Module) -> bool:
    return _LEAVES.get(module, False)


# Modules that are a gather unit of their own even inside a block (TiledLinear's tiles, zero/tiling.py): the
# point of tiling is that no rank gathers more of the operator than one tile. A leaf around them still wins.
_OWN_UNITS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def set_own_unit(module: nn.Module) -> None:
    """Make ``module``'s subtree a gather unit of its own at every granularity (unless inside a leaf)."""
    _OWN_UNITS[module] = True


def mark_leaves(model: nn.Module, classes: Iterable[Union[type, str]] = (), names: Iterable[str] = (),
                suffixes: Iterable[str] = (), flag: bool = True) -> list[nn.Module]:
    """Mark the modules of ``model`` that are instances of ``classes`` (types, or class names: bare or with
    their module path), named one of ``names`` in ``named_modules()``, or whose name ends with one of
    ``suffixes``; returns them, in model order."""
    classes, names, suffixes = list(classes), set(names), tuple(suffixes)
    out = []
    for name, module in model.named_modules():
        cls = type(module)
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        hit = any(isinstance(module, c) if isinstance(c, type) else c in (cls.__name__, qualified) for c in classes)
        if hit or name in names or (suffixes and name.endswith(suffixes)):
            set_leaf(module, flag)
            out.append(module)
    return out


# Note [granularity threshold]: DeepSpeed's stage3_module_granularity_threshold. A module's granularity is its
# subtree's parameter count over (1 + the torch leaf modules with parameters under it): small, many-layered
# modules score low. The outermost module scoring at or under the threshold becomes a leaf, so one gather serves
# its whole subtree instead of one per layer. As in DeepSpeed: modules without parameters, torch leaf modules,
# torch's containers (ModuleList, Sequential...: their children keep their own forwards) and subtrees over 1e9
# parameters never score.
_NEVER = float("inf")
_MAX_LEAF = 1e9
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def granularities(model: nn.Module) -> dict[nn.Module, float]:
    """Every module's granularity score (Note [granularity threshold]); ``inf`` for those that never score."""
    score: dict[nn.Module, float] = {}

    def visit(module: nn.Module) -> tuple[int, int]:  # (torch leaf layers with parameters, parameters)
        own = sum(p.numel() for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            score[module] = _NEVER
            return (1, own) if own else (0, 0)
        layers, params = 0, own
        for child in children:
            child_layers, child_params = visit(child)
            layers, params = layers + child_layers, params + child_params
        if params == 0 or type(module) in _CONTAINERS:
            score[module] = _NEVER
            return layers, params
        layers += 1
        score[module] = params // layers if params <= _MAX_LEAF else _NEVER
        return layers, params

    visit(model)
    return score


def granular_leaves(model: nn.Module, threshold: int) -> list[nn.Module]:
    """The modules DeepSpeed's granularity threshold makes leaves: outermost first, none inside another."""
    score = granularities(model)
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if score[module] <= threshold:
            out.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return out


def block_names(model: nn.Module) -> list[str]:
    """Names of the modules that are children of an ``nn.ModuleList`` (transformer layers, typically)."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            out += [f"{name}.{child}" if name else child for child, _ in mod.named_children()]
    return out


def outer_block_names(model: nn.Module) -> list[str]:
    """The blocks not inside another block: the units of granularity "block" (nested lists stay in one)."""
    blocks = block_names(model)
    return [b for b in blocks if _enclosing_block(b, blocks) == b]


def _enclosing_block(module_name: str, blocks: list[str]) -> str | None:
    inside = [b for b in blocks if module_name == b or module_name.startswith(b + ".")]
    return min(inside, key=len) if inside else None  # the outermost block: nested lists stay in one unit


def plan_units(model: nn.Module, granularity: str = "module") -> list[UnitPlan]:
    """Group the model's unique parameters into gather units, in module definition order."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"gather granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if is_leaf(model):  # the whole model marked a leaf (DeepSpeed's tests do it): one unit of everything
        unique = list(model.named_parameters())  # each parameter once, under its first name
        return [UnitPlan("", model, unique)] if unique else []
    blocks = block_names(model) if granularity == "block" else []
    leaves = [name for name, mod in model.named_modules() if is_leaf(mod) and name]
    own = [name for name, mod in model.named_modules() if _OWN_UNITS.get(mod, False) and name]
    holders: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    by_id: dict[int, nn.Parameter] = {}
    modules = dict(model.named_modules())
    for mname, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(mname)
            by_id[id(p)] = p
    for name, p in model.named_parameters():  # first (canonical) name, as state_dict lists it first
        first_name.setdefault(id(p), name)
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"parameter {name!r} is not initialized yet (a lazy module's, such as nn.LazyLinear): "
                             "its shape is unknown until the module's first forward, and partitioning needs it; "
                             "run the model once on a sample batch before zeropp.initialize")
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for pid, mnames in holders.items():
        owner = _common_ancestor(mnames) if len(set(mnames)) > 1 else mnames[0]
        own_unit = None if _enclosing_block(owner, leaves) else _enclosing_block(owner, own)
        owner = own_unit or _enclosing_block(owner, blocks + leaves) or owner
        owned.setdefault(owner, []).append((first_name[pid], by_id[pid]))
    return [UnitPlan(m, modules[m], owned[m]) for m in modules if m in owned]
