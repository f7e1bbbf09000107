"""Which module gathers which parameter.

A parameter held by one module belongs to that module's unit. A parameter held by several modules (tied
weights, e.g. a token embedding reused as the output projection) belongs to their lowest common ancestor,
so it is gathered once per forward and once per backward and stays available to every user in between.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def plan_units(model: nn.Module) -> list[UnitPlan]:
    """Group the model's unique parameters into gather units, in module definition order."""
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
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for pid, mnames in holders.items():
        owner = _common_ancestor(mnames) if len(set(mnames)) > 1 else mnames[0]
        owned.setdefault(owner, []).append((first_name[pid], by_id[pid]))
    return [UnitPlan(m, modules[m], owned[m]) for m in modules if m in owned]
