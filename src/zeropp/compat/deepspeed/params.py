"""DeepSpeed's ``ds_*`` parameter attributes, as read-only views of zeropp's state (never copies of it).

While the ``deepspeed`` alias is installed, each parameter that becomes partitioned (under ``zero.Init``, by
``from_pretrained`` or by a stage-3 engine) takes :class:`DeepSpeedParameter` as its class: an ``nn.Parameter``
subclass with no state of its own, whose properties read where zeropp keeps the truth (the engine's units,
``partition.construction.PARAMS``), so they cannot go stale. Writing one raises, saying what to do instead.

* ``ds_numel``, ``ds_shape``: the full size and shape (zeropp keeps them as ``numel()`` and ``shape`` too);
* ``ds_status``: :class:`ZeroParamStatus` ``AVAILABLE`` while gathered, ``INFLIGHT`` while a gather is on its way,
  else ``NOT_AVAILABLE``;
* ``ds_tensor``: this rank's part of the values (a copy, in the parameter's dtype; padding left out);
* ``ds_id``: a number unique among the parameters of its engine (or of those partitioned at construction);
* ``ds_persist``: whether its unit persists (stays gathered between passes: Note [persistent units]);
* ``ds_secondary_tensor``: this rank's slice of it in hpZ's secondary copy (a copy), or None without hpZ or while
  no current slice exists (from an optimizer step to the next forward; one is cut at initialize);
* ``ds_zero_param_process_group``: the process group of that secondary partition, or None without hpZ.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zeropp.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zeropp.partition import listeners
from zeropp.partition.construction import PARAMS, State
from zeropp.partition.unit import UnitState
from zeropp.zero import param_state as ps
from zeropp.zero.deepspeed_surface import DeepSpeedAPIError


class DeepSpeedParameter(nn.Parameter):
    """A partitioned parameter, with DeepSpeed's ``ds_*`` names as read-only views (see the module)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # as nn.Parameter: no subclass dispatch

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("ds_") and name in _VIEWS:
            raise DeepSpeedAPIError(f"param.{name} is read-only in zeropp (a view of the engine's state); change "
                                    "parameters inside zeropp.zero.GatheredParameters(params, modifier_rank=0)")
        super().__setattr__(name, value)

    @property
    def ds_numel(self) -> int:
        return self.numel()

    @property
    def ds_shape(self) -> torch.Size:
        return self.shape

    @property
    def ds_persist(self) -> bool:
        loc = ps.locate(self)
        kept = getattr(loc.engine, "kept", None) if loc is not None else None
        return kept is not None and loc.unit in kept

    @property
    def ds_status(self) -> ZeroParamStatus:
        loc = ps.locate(self)
        if loc is not None:
            if loc.unit.state is UnitState.GATHERED:
                return ZeroParamStatus.AVAILABLE
            inflight = loc.unit in getattr(loc.engine, "_inflight", {})
            return ZeroParamStatus.INFLIGHT if inflight else ZeroParamStatus.NOT_AVAILABLE
        rec = PARAMS.get(self)
        if rec is not None and rec.state is State.PARTITIONED:
            return ZeroParamStatus.NOT_AVAILABLE
        return ZeroParamStatus.AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        loc = ps.locate(self)
        if loc is not None:
            return ps.local_master(loc).to(self.dtype)
        rec = PARAMS.get(self)
        if rec is None:
            raise DeepSpeedAPIError("param.ds_tensor: the parameter is not partitioned")
        start, stop = rec.spec.owned(PARAMS.comm.topo.rank)
        return rec.shard[: stop - start].clone()

    @property
    def ds_secondary_tensor(self) -> Optional[torch.Tensor]:
        loc = ps.locate(self)
        return None if loc is None else ps.secondary_part(loc)

    @property
    def ds_zero_param_process_group(self) -> Any:
        loc = ps.locate(self)
        return None if loc is None else ps.hpz_group(loc)

    @property
    def ds_id(self) -> int:
        loc = ps.locate(self)
        if loc is not None:
            order = [s.param for u in loc.engine.units for s in u.slots]
            return next(i for i, p in enumerate(order) if p is self)
        rec = PARAMS.get(self)
        if rec is None:
            raise DeepSpeedAPIError("param.ds_id: the parameter is not partitioned")
        return rec.serial


_VIEWS = {name for name, value in vars(DeepSpeedParameter).items() if isinstance(value, property)}


def give_views(param: nn.Parameter) -> None:
    """Make ``param`` a :class:`DeepSpeedParameter` (a plain ``nn.Parameter`` only: a user's subclass is left)."""
    if type(param) is nn.Parameter:
        param.__class__ = DeepSpeedParameter


def install() -> None:
    listeners.listen(give_views)


def uninstall() -> None:
    listeners.unlisten(give_views)
