"""The gradient intake, a part the engine owns (:class:`GradIntake`): each gradient a backward produces, handed
to the reduce buckets in an order every rank shares, and what arrived in this backward and in this accumulation
window (for the unused-parameter check, frozen parameters and the window's step).
"""
from __future__ import annotations

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm
from zeropp.comm.strategy import ReduceStrategy
from zeropp.config.policy import bucket_capacity
from zeropp.config.policy import StagePlan, TrainPolicy
from zeropp.offload.link import HostLink
from zeropp.offload.residency import Resident
from zeropp.partition.unit import Unit
from zeropp.topology import Topology
from zeropp.zero.buckets import GradBuckets
from zeropp.zero.order_check import REDUCE, CollectiveOrder


class UnusedParametersError(RuntimeError):
    """Stages 1-2 with ``ignore_unused_parameters: false``: a trainable parameter got no gradient in a backward."""


class GradIntake:
    """Gradients into reduce buckets of ``policy.reduce_bucket_size`` (see the module docstring), reduced by
    ``reduce`` into the rows of ``stepped``, the units that train (offloaded rows cross ``link``)."""

    def __init__(self, reduce: ReduceStrategy, order: CollectiveOrder, *, stepped: list[Unit], policy: TrainPolicy,
                 plan: StagePlan, topo: Topology, comm: Comm, residency: Resident, link: HostLink) -> None:
        self.buckets = GradBuckets(reduce, plan.shard_world(topo.world_size), bucket_capacity(policy.reduce_bucket_size), residency, link,
                                   direct=topo.world_size == 1)
        self.stepped = stepped
        self.order, self.policy, self.plan, self.topo, self.comm = order, policy, plan, topo, comm
        self._missing: dict[Unit, int] = {}  # gradients a unit still waits for in this backward
        self._seen: set[tuple[int, int]] = set()  # (unit, slot) whose gradient arrived this backward
        self._staged: dict[Unit, list[tuple[int, torch.Tensor]]] = {}  # gradients of leaf units not yet complete
        self._window: set[tuple[int, int]] = set()  # (unit, slot) with a gradient in this accumulation window

    def begin_backward(self) -> None:
        self._missing, self._seen, self._staged = {}, set(), {}

    def arrive(self, unit: Unit, slot_index: int, grad: torch.Tensor, whole: bool) -> bool:
        """A parameter's gradient, from its hook; True once every gradient the unit needs is in. ``whole``: the
        unit is a leaf module's, whose gradients are bucketed together (Note [partly used units]); other units
        hand each gradient to the buckets as it arrives."""
        self._seen.add((unit.index, slot_index))
        self._window.add((unit.index, slot_index))
        left = (self._missing[unit] if unit in self._missing else unit.needs_grad()) - 1
        self._missing[unit] = left
        if whole:
            self._staged.setdefault(unit, []).append((slot_index, grad))
            if left > 0:
                return False
            for index, g in self._staged.pop(unit):
                self._add(unit, index, g)
        else:
            self._add(unit, slot_index, grad)
        return left == 0

    def _add(self, unit: Unit, slot_index: int, grad: torch.Tensor) -> None:
        self.order.note(REDUCE, unit.index, slot_index)  # the add order decides what each bucket holds
        self.buckets.add(unit, slot_index, grad)

    def finish_backward(self) -> None:
        """The backward is over: the leaf units still waiting go to the buckets, the buckets are reduced, and
        stages 1-2 with ``ignore_unused_parameters: false`` check that every parameter got its gradient."""
        self._bucket_partly_used()
        self.buckets.finish()
        if not self.policy.ignore_unused_parameters and self.plan.shards_optimizer and not self.plan.shards_weights:
            self._check_unused()

    def got_in_window(self, unit: Unit, index: int) -> bool:
        """Whether the parameter got a gradient in this accumulation window (by its hook at stages 2-3, in its
        accumulated ``.grad`` at stages 0-1)."""
        if self.plan.reduces_as_ready:
            return (unit.index, index) in self._window
        return unit.slots[index].param.grad is not None

    def close_window(self) -> None:
        """The window's step ran: the next gradients open a new window."""
        self._window = set()

    def _bucket_partly_used(self) -> None:
        """Note [partly used units]: a leaf module (``set_z3_leaf_modules``, ``leaf_module``, the granularity
        threshold) is one unit over several modules, and ranks may use different parts of it: a mixture of
        experts whose tokens went to other experts on another rank, a forward that picks a child by rank. Each
        rank would hand the buckets only what it used, in its own order, and the ranks' buckets would pair
        different parameters. So a leaf unit's gradients wait until all of them are in; those of a leaf unit
        still waiting when backward ends go to the buckets in slot order, zeros for the parameters it did not
        use, in unit order: the same adds on every rank whose backward reached the same units. Other units
        hand each gradient over as it arrives (the earliest reduction); ranks that use different parts of one
        of them, or run different units, are refused by the collective order check."""
        for unit in sorted(self._staged, key=lambda u: u.index):
            got = dict(self._staged[unit])
            for index, slot in enumerate(unit.slots):
                if slot.trainable:
                    grad = got.get(index)
                    if grad is None:
                        grad = torch.zeros(slot.param.shape, dtype=self.policy.compute_dtype, device=unit.device)
                    self._add(unit, index, grad)
        self._staged = {}

    def _check_unused(self) -> None:
        """Stages 1-2 with ``ignore_unused_parameters: false`` (DeepSpeed's check): every trainable parameter must
        have a gradient after each backward; the ranks agree (one all-reduce), so every rank raises."""
        arrived = (lambda u, i, s: (u.index, i) in self._seen) if self.plan.reduces_as_ready else \
            (lambda u, i, s: s.param.grad is not None)
        unused = [s.name for u in self.stepped for i, s in enumerate(u.slots)
                  if s.param.requires_grad and not arrived(u, i, s)]
        flags = torch.zeros(self.topo.world_size)
        flags[self.topo.rank] = float(bool(unused))
        self.comm.all_reduce(flags, self.topo.world, Phase.OTHER)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if ranks:
            raise UnusedParametersError(
                f"parameters {unused[:10] or '(on other ranks)'} got no gradient in this backward (rank(s) {ranks}): "
                "they were not used to compute the loss. Set zero_optimization.ignore_unused_parameters to true (the "
                "default) to train on without them, or remove them from the model or from model_parameters")

    def reduce_whole(self, units: list[Unit]) -> None:
        """Stages 0-1, at the boundary: reduce every accumulated full gradient into its shard.

        A trainable parameter without a gradient on this rank contributes zeros, so every rank reduces the
        same buckets in the same order even when some rank's forward skipped a module.
        """
        for unit in units:
            for index, slot in enumerate(unit.slots):
                p = slot.param
                if not slot.trainable:  # (one frozen for this micro-step only still has its window's gradient)
                    continue
                grad = p.grad if p.grad is not None else torch.zeros(p.shape, dtype=self.policy.compute_dtype,
                                                                     device=unit.device)
                p.grad = None
                self.order.note(REDUCE, unit.index, index)
                self.buckets.add(unit, index, grad)
        self.buckets.finish()
