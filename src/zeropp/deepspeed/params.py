"""DeepSpeed's ``ds_*`` parameter attributes, as read-only views of zeropp's state (never copies of it).

While the ``deepspeed`` alias is installed, each parameter that becomes partitioned (under ``zero.Init``, by
``from_pretrained`` or by a stage-3 engine) takes :class:`DeepSpeedParameter` as its class: an ``nn.Parameter``
subclass with no state of its own, whose properties read where zeropp keeps the truth (the engine's units,
``partition.construction.PARAMS``), so they cannot go stale. Writing one raises, saying what to do instead.

* ``ds_numel``, ``ds_shape``: the full size and shape (zeropp keeps them as ``numel()`` and ``shape`` too);
* ``ds_status``: :class:`ZeroParamStatus` ``AVAILABLE`` while gathered, ``INFLIGHT`` while a gather is on its way,
  else ``NOT_AVAILABLE``;
* ``ds_tensor``: this rank's part of the values (a copy, in the parameter's dtype; padding left out), a
  :class:`PartitionTensor`: ``param.ds_tensor.data = value`` writes the part (DeepSpeed's way to set a rank's
  partition; here into the fp32 master, which becomes the weights), and an in-place change of it raises;
* ``ds_id``: a number unique among the parameters of its engine (or of those partitioned at construction);
* ``ds_persist``: whether its unit persists (stays gathered between passes: Note [persistent units]);
* ``ds_secondary_tensor``: this rank's slice of it in hpZ's secondary copy (a copy), or None without hpZ or while
  no current slice exists (from an optimizer step to the next forward; one is cut at initialize);
* ``ds_zero_param_process_group``: the process group of that secondary partition, or None without hpZ.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from zeropp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zeropp.partition import listeners
from zeropp.partition.access import is_inplace
from zeropp.zero.construction import PARAMS, State
from zeropp.partition.unit import UnitState
from zeropp.zero import param_state as ps
from zeropp.zero.gathered import GatheredParameters
from zeropp.deepspeed.missing import DeepSpeedAPIError


class PartitionTensor(torch.Tensor):
    """``param.ds_tensor``: a copy of this rank's part of a partitioned parameter. Assigning its ``data`` writes
    the part through ``write`` (DeepSpeed's ``param.ds_tensor.data = value``); an in-place operation on it would
    change only the copy, so it raises. Every other operation gives plain tensors."""

    _write: Callable[[torch.Tensor], None]

    @staticmethod
    def of(values: torch.Tensor, write: Callable[[torch.Tensor], None]) -> "PartitionTensor":
        t = torch.Tensor._make_subclass(PartitionTensor, values, False)
        t._write = write
        return t

    @property  # type: ignore[override]
    def data(self) -> "PartitionTensor":
        return self

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._write(value)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inplace = is_inplace(name)
        if (inplace and args and isinstance(args[0], PartitionTensor)) or isinstance(kwargs.get("out"), cls):
            raise DeepSpeedAPIError(f"{name} on param.ds_tensor: zeropp's ds_tensor is a copy of this rank's part, "
                                    "so an in-place change would be lost; assign param.ds_tensor.data = value, or "
                                    "use deepspeed.utils.safe_set_local_fp32_param")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _local_part(value: torch.Tensor, owned: int, chunk: int, what: str) -> torch.Tensor:
    """The ``owned`` elements of a value for this rank's part (a padded chunk's padding is dropped)."""
    flat = value.detach().reshape(-1)
    if flat.numel() not in (owned, chunk):
        raise ValueError(f"param.ds_tensor.data = value: {what} owns {owned} elements here (a chunk of {chunk} "
                         f"with padding), the value has {flat.numel()}")
    return flat[:owned]


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
        return loc is not None and loc.unit in loc.engine.state.kept

    @property
    def ds_status(self) -> ZeroParamStatus:
        loc = ps.locate(self)
        if loc is not None:
            return _unit_status(loc.engine, loc.unit)
        rec = PARAMS.get(self)
        if rec is not None and rec.state is State.PARTITIONED:
            return ZeroParamStatus.NOT_AVAILABLE
        return ZeroParamStatus.AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        loc = ps.locate(self)
        if loc is not None:
            def write_master(value: torch.Tensor, loc: ps.Located = loc) -> None:
                start, stop = loc.span
                part = _local_part(value, stop - start, loc.slot.spec.chunk, repr(loc.slot.name))
                ps.set_master(loc, part, local=True)
            return PartitionTensor.of(ps.local_master(loc).to(self.dtype), write_master)
        rec = PARAMS.get(self)
        if rec is None:
            raise DeepSpeedAPIError("param.ds_tensor: the parameter is not partitioned")
        start, stop = rec.spec.owned(PARAMS.comm.topo.rank)

        def write_shard(value: torch.Tensor) -> None:
            part = _local_part(value, stop - start, rec.spec.chunk, repr(rec.label))
            with torch.no_grad():
                rec.shard[: stop - start].copy_(part)
        return PartitionTensor.of(rec.shard[: stop - start].clone(), write_shard)

    @property
    def ds_secondary_tensor(self) -> Optional[torch.Tensor]:
        loc = ps.locate(self)
        return None if loc is None else ps.secondary_part(loc)

    @property
    def ds_zero_param_process_group(self) -> Any:
        loc = ps.locate(self)
        return None if loc is None else ps.hpz_group(loc)

    @property
    def ds_active_sub_modules(self) -> set[int]:
        """DeepSpeed's set of the running modules that hold the parameter gathered: always empty here (a new set
        each time), since zeropp gathers units, not parameters, and counts no modules per parameter; clearing it
        (TRL's generation does) changes nothing."""
        return set()

    def ds_summary(self, use_debug_name: bool = False) -> dict[str, Any]:
        """DeepSpeed's summary of the parameter's ZeRO state, from the views above. ``active_sub_modules``
        (DeepSpeed's count of running modules that hold it gathered) is left out: zeropp gathers units, not
        parameters, and keeps no such count."""
        return {"id": self.ds_id, "status": self.ds_status.name, "numel": self.numel(), "ds_numel": self.ds_numel,
                "shape": tuple(self.shape), "ds_shape": tuple(self.ds_shape), "requires_grad": self.requires_grad,
                "grad_shape": tuple(self.grad.shape) if self.grad is not None else None,
                "persist": self.ds_persist, "ds_tensor.shape": tuple(self.ds_tensor.shape)}

    def all_gather_coalesced(self, params: Optional[list[nn.Parameter]] = None, safe_mode: bool = False,
                             quantize: bool = False) -> "GatherHandle":
        """DeepSpeed's gather of partitioned parameters (``params``, default this one): collective, every rank
        calls. Each then holds its full value (``param.data``) until :meth:`partition` (also collective) or the
        engine's next release of its unit, through ``zeropp.zero.GatheredParameters`` (values from the fp32 masters,
        cast to the compute dtype; a write to them is refused at ``partition()``, as there). Returns a handle whose
        ``wait()`` returns at once: the gather is done. ``quantize=True`` (qwZ's int8 gather) is not supported here;
        ``safe_mode`` (DeepSpeed's consistency checks) changes nothing."""
        if quantize:
            raise DeepSpeedAPIError("param.all_gather_coalesced(quantize=True): zeropp gathers these values from the "
                                    "fp32 masters; leave quantize False (qwZ quantizes the forward's gathers)")
        chosen = [self] if params is None else [p for p in params if p is not None]
        chosen = [p for p in chosen if id(p) not in _OPEN]  # gathered already: held until partition()
        if chosen:
            block = GatheredParameters(chosen)
            block.__enter__()
            for p in chosen:
                _OPEN[id(p)] = block
        return GatherHandle()

    def partition(self, param_list: Optional[list[nn.Parameter]] = None, hierarchy: int = 0,
                  has_been_updated: bool = False, free_data: bool = True) -> None:
        """Release what :meth:`all_gather_coalesced` gathered for these parameters (``param_list``, default this
        one), with every parameter gathered together with them; collective. DeepSpeed's ``has_been_updated``
        (publish a write) is refused: change parameters inside ``GatheredParameters(params, modifier_rank=0)``."""
        if has_been_updated:
            raise DeepSpeedAPIError("param.partition(has_been_updated=True): change parameters inside "
                                    "zeropp.zero.GatheredParameters(params, modifier_rank=0), which publishes them")
        chosen = [self] if param_list is None else list(param_list)
        blocks = {id(_OPEN[id(p)]): _OPEN[id(p)] for p in chosen if id(p) in _OPEN}
        for block in blocks.values():
            for p in block.params:
                _OPEN.pop(id(p), None)
            block.__exit__(None, None, None)

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
_OPEN: dict[int, GatheredParameters] = {}  # parameters all_gather_coalesced holds gathered, until partition()


class GatherHandle:
    """What ``all_gather_coalesced`` returns (DeepSpeed's handle): the gather is complete when it is made."""

    def wait(self, handle_dependency: bool = True) -> None:
        """Nothing to wait for."""


def _unit_status(engine: Any, unit: Any) -> ZeroParamStatus:
    if unit.state is UnitState.GATHERED:
        return ZeroParamStatus.AVAILABLE
    return ZeroParamStatus.INFLIGHT if engine.gathers.prefetching(unit) else ZeroParamStatus.NOT_AVAILABLE


class _SavedWeightStatus:
    """``ds_status`` of a plain tensor over a stage-3 unit's weights (Note [saved weights' ds_status])."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        hit = ps.unit_sharing(obj)
        if hit is None:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute 'ds_status'")
        return _unit_status(*hit)


# Note [saved weights' ds_status]: autograd hands a custom function's backward the tensors it saved; with
# saved-tensor hooks installed (stage 3 installs them for every pass, to gather a released unit when its saved
# weights are unpacked) each comes back as a new plain tensor over the same storage, never the parameter
# itself. DeepSpeed installs no such hooks, so its parameters come back as themselves, and code written for it
# reads their ``ds_status`` there (TRL's fused LM-head loss: ``maybe_gather_lm_head_ctx(weight)`` in its
# backward). While the alias is installed, ``torch.Tensor.ds_status`` answers for a tensor sharing a unit's
# storage (AVAILABLE once the unpack gathered it) and raises AttributeError for every other tensor, as before,
# so ``hasattr(t, "ds_status")`` stays false for them. No other ``ds_*`` name is given to plain tensors.
_TENSOR_STATUS = _SavedWeightStatus()


def give_views(param: nn.Parameter) -> None:
    """Make ``param`` a :class:`DeepSpeedParameter` (a plain ``nn.Parameter`` only: a user's subclass is left)."""
    if type(param) is nn.Parameter:
        param.__class__ = DeepSpeedParameter


def install() -> None:
    listeners.listen(give_views)
    torch.Tensor.ds_status = _TENSOR_STATUS  # type: ignore[attr-defined]  # Note [saved weights' ds_status]


def uninstall() -> None:
    listeners.unlisten(give_views)
    if vars(torch.Tensor).get("ds_status") is _TENSOR_STATUS:
        del torch.Tensor.ds_status
