"""The optimizer ``deepspeed.initialize`` returns: DeepSpeed's ZeRO optimizer as scripts and DeepSpeed's own tests
read it, over the torch optimizer the engine steps.

DeepSpeed returns a wrapper (``DeepSpeedZeroOptimizer`` for stages 1-2, ``DeepSpeedZeroOptimizer_Stage3``) whose
``optimizer`` is the torch optimizer over fp32 partitions. zeropp's engine steps a torch optimizer over each
parameter's fp32 master chunk, so the wrapper here is a view: ``optimizer`` is that torch optimizer
(its ``state[master]["step"]`` is Adam's step count), stage 3's ``fp16_groups`` / ``fp32_partitioned_groups_flat``
pair each master with its parameter (one sub-group per parameter), stages 1-2's ``bit16_groups`` /
``single_partition_of_fp32_groups`` do the same per parameter group. Under the alias, ``engine.optimizer`` is this
view too (``runtime/engine.py``).

Its ``step()`` is DeepSpeed's ZeRO optimizer step: the engine's optimizer step on the gradients accumulated so far,
without advancing the engine's step counters or learning-rate schedule (``engine.step()`` does all of it);
``zero_grad()`` makes the next backward start a new accumulation (until it runs, the gradients stay, as in
DeepSpeed, where ``zero_grad(); step()`` steps on them). A rank's gradient partition (``averaged_gradients``,
``get_fp32_grad_partitions()``) is its chunk of each parameter, zero padding included (Note [shard layout]).
A DeepSpeed name this view lacks raises :class:`DeepSpeedAPIError` naming it; any other name an AttributeError
(``hasattr`` answers False, as with DeepSpeed's optimizer).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from zeropp.partition.access import is_inplace
from zeropp.zero import param_state as ps
from zeropp.deepspeed.missing import DeepSpeedAPIError, is_missing, missing
from zeropp.deepspeed.runtime.zero.parameter_offload import ParameterOffload


_OFFERED = ("zeropp's view offers optimizer, param_groups, state, fp16_groups, fp32_partitioned_groups_flat, "
            "bit16_groups, single_partition_of_fp32_groups, parallel_partitioned_bit16_groups, averaged_gradients, "
            "get_fp32_grad_partitions, nccl_start_alignment_factor, loss_scale, overflow, _get_norm_groups, "
            "_global_grad_norm, state_dict, step, zero_grad and (stage 3) parameter_offload")


class ZeroOptimizerView:
    """DeepSpeed's ZeRO optimizer attributes, read from a zeropp engine (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over the fp32 master chunks (DeepSpeed's ``optimizer.optimizer``)."""
        return self._engine.master_optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._engine.master_optimizer.param_groups

    @property
    def state(self) -> Any:
        return self._engine.master_optimizer.state

    @property
    def defaults(self) -> dict:
        return self._engine.master_optimizer.defaults

    def _located(self) -> list[tuple[ps.Located, torch.Tensor]]:
        """(where the parameter lives, its fp32 master chunk) for every master the optimizer steps, in the
        optimizer's order."""
        engine = self._engine
        of_master = {id(view): ps.Located(engine, u, i) for u in engine.units
                     for i, view in enumerate(u.master_views())}
        return [(of_master[id(m)], m) for g in self.param_groups for m in g["params"] if id(m) in of_master]

    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, its fp32 master chunk) for every master the optimizer steps, in the optimizer's order."""
        return [(loc.slot.param, m) for loc, m in self._located()]

    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """Stage 3: the parameters of each sub-group (here one parameter each, as zeropp steps per parameter)."""
        return [[p] for p, _ in self._pairs()]

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """Stage 3: each sub-group's fp32 partition, the key of its state in ``optimizer.state``."""
        return [m for _, m in self._pairs()]

    @property
    def bit16_groups(self) -> list[list[torch.nn.Parameter]]:
        """Stages 1-2: the parameters of each parameter group."""
        params = {id(m): p for p, m in self._pairs()}
        return [[params[id(m)] for m in g["params"] if id(m) in params] for g in self.param_groups]

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """Stages 1-2: each parameter group's fp32 partition on this rank, one flat tensor per group as in DeepSpeed:
        the group's master chunks in the optimizer's order, zero padding included (Note [shard layout]; DeepSpeed
        cuts one flat buffer per group instead, so the elements of a rank's partition differ). Each is a
        :class:`GroupPartition` over the masters: read at this access, and an in-place write to it (``copy_``,
        ``mul_``, ``.data = value``) is written into the masters, which the next optimizer step steps and publishes
        as the weights, as DeepSpeed's does."""
        engine = self._engine
        engine.join_update()
        unit_of = {id(m): loc.unit for loc, m in self._located()}
        out = []
        for group in self.param_groups:
            masters = [m for m in group["params"] if id(m) in unit_of]
            units = list({id(unit_of[id(m)]): unit_of[id(m)] for m in masters}.values())
            with engine.state.residency.resident(units, dirty=False):
                flat = torch.cat([m.detach().reshape(-1) for m in masters]) if masters else torch.zeros(0)
            out.append(GroupPartition.of(flat, functools.partial(_write_masters, engine, masters, units)))
        return out

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    cur_scale = loss_scale

    @property
    def _global_grad_norm(self) -> Optional[float]:
        """The gradients' global norm at the last step (before clipping), as DeepSpeed's optimizer keeps it."""
        return self._engine.get_global_grad_norm()

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """Each sub-group's gradient norm as the next step sees it (here one per parameter, the sub-groups of
        ``fp16_groups``); collective, so every rank calls. Their L2 norm is the global gradient norm."""
        return ps.grad_norms([loc for loc, _ in self._located()])

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped (a non-finite gradient; fp16's overflow)."""
        return self._engine.was_step_skipped()

    def _grad_partitions(self) -> dict[int, list[torch.Tensor]]:
        """Per parameter group, this rank's fp32 gradient chunk of each parameter (zeros before any backward)."""
        located = self._located()
        grads = {id(m): g for (_, m), g in zip(located, ps.local_grads([loc for loc, _ in located], padded=True))}
        return {gi: [torch.zeros(m.numel(), dtype=torch.float32) if grads[id(m)] is None else grads[id(m)]
                     for m in group["params"] if id(m) in grads]
                for gi, group in enumerate(self.param_groups)}

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """Stages 2-3: this rank's averaged gradient partition of each parameter, per parameter group (copies)."""
        return self._grad_partitions()

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """Stage 3: ``{group: {index in the group: this rank's fp32 gradient partition}}`` (copies)."""
        return {gi: dict(enumerate(parts)) for gi, parts in self._grad_partitions().items()}

    #: partitions start at an even element (Note [shard layout]: chunks are even), as DeepSpeed's NCCL alignment
    nccl_start_alignment_factor = 2

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """Stages 1-2: each parameter's resident 16-bit weights as the ranks' partitions (views; one group per
        parameter, as the engine keeps one buffer per parameter rather than per parameter group)."""
        if self._engine.plan.shards_weights:
            raise DeepSpeedAPIError("parallel_partitioned_bit16_groups: stage 3 keeps no resident 16-bit weights; "
                                    "read param.ds_tensor for this rank's partition")
        out = []
        for loc, _ in self._located():
            slot = loc.slot
            out.append(list(slot.full.view(loc.unit.world, slot.spec.chunk).unbind(0)))
        return out

    def state_dict(self) -> dict:
        """This rank's part of the optimizer state (the torch optimizer's over its master chunks)."""
        return self._engine.master_optimizer.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward starts a new accumulation (the gradients so far are dropped as it begins; the engine
        also clears them at each step)."""
        self._engine.restart_accumulation()

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's ZeRO optimizer step (see the module docstring); collective. ``closure`` is refused."""
        if closure is not None:
            raise DeepSpeedAPIError("the ZeRO optimizer's step(closure): a closure re-evaluates the loss, which a "
                                    "ZeRO step cannot do; run forward/backward, then step()")
        self._engine.step_optimizer_now()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if is_missing("optimizer", name):
            raise missing("optimizer", name, _OFFERED)
        # not a DeepSpeed name either: an AttributeError, so that hasattr() answers False as with DeepSpeed's
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} ({_OFFERED})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._engine.master_optimizer!r})"


class GroupPartition(torch.Tensor):
    """``single_partition_of_fp32_groups[i]``: a flat copy of one parameter group's fp32 master chunks on this rank.
    An in-place operation on it (or ``.data = value``) changes the copy and writes it into the masters; every other
    operation gives plain tensors."""

    _write: Callable[[torch.Tensor], None]

    @staticmethod
    def of(values: torch.Tensor, write: Callable[[torch.Tensor], None]) -> "GroupPartition":
        t = torch.Tensor._make_subclass(GroupPartition, values, False)
        t._write = write
        return t

    @property  # type: ignore[override]
    def data(self) -> "GroupPartition":
        return self

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self.copy_(value)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args and is_inplace(getattr(func, "__name__", "")) else kwargs.get("out")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if isinstance(target, GroupPartition):
                target._write(target)  # the changed copy into the masters
        return out


def _write_masters(engine: Any, masters: list[torch.Tensor], units: list[Any], flat: torch.Tensor) -> None:
    """Copy ``flat`` (a group partition) into the group's master chunks; the next step steps them."""
    engine.join_update()  # a delayed update still running writes the same masters
    with torch.no_grad(), engine.state.residency.resident(units):
        at = 0
        for m in masters:
            m.copy_(flat[at : at + m.numel()].view_as(m))
            at += m.numel()


class DeepSpeedZeroOptimizer(ZeroOptimizerView):
    """What ``deepspeed.initialize`` returns as the optimizer at stages 0-2 (DeepSpeed's name, for isinstance)."""


class DeepSpeedZeroOptimizer_Stage3(ZeroOptimizerView):  # noqa: N801 (DeepSpeed's class name)
    """What ``deepspeed.initialize`` returns as the optimizer at stage 3 (DeepSpeed's name, for isinstance)."""

    @property
    def parameter_offload(self) -> ParameterOffload:
        """The module hooks as TRL's generation takes them off and puts them back (``parameter_offload.py``)."""
        return ParameterOffload(self._engine)
