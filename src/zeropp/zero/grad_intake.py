"""The gradient intake, a part the engine owns (:class:`GradIntake`): each gradient a backward produces, placed
into the reduce buckets by a layout every rank shares (Note [positional buckets] in ``zero/buckets.py``), and
what arrived in this backward and in this accumulation window (for the unused-parameter check, frozen
parameters and the window's step).

Note [extra gradients]. A gradient the bucket layout has no place for (a module run once more than in the
backward the layout follows: a shared layer under reentrant checkpointing in the first step, a loop whose
length changed) cannot be reduced then: the other ranks may not have it, and a reduction only this rank issues
would pair with another collective. It is kept, summed in fp32, until the step. The step's all-reduce carries
a digest of each rank's extra gradients (Note [collective order]): where every rank has the same ones, they
are reduced then, in one order, and the norm is taken again; where the ranks differ, the step is refused by
name on every rank. Where the ranks' arrivals agreed, the layout then takes in the most runs each parameter had
in a backward of the window, so the next step places them. (Where they never agree, as under LayerDrop, a
module with repeated runs that some rank skips is refused at every step.)

Note [arrival order at stage 3]. At stage 3 the backward's reductions share their process group with its weight
gathers, so each rank must issue them at the same points between its gathers. A bucket reduced once its places
are filled is reduced at a point that depends on what the rank ran: ranks that ran different modules would
interleave reductions and gathers differently and hang (measured: a rank that shuffled its blocks, one waiting in
a gather, the other in a reduction). So stage 3 fills buckets in arrival order, as the gathers are issued, and a
rank that ran different modules is refused by the collective order check, which covers the order gradients
arrived in there.
"""
from __future__ import annotations

import torch

from typing import Optional

from zeropp.comm.ledger import Phase
from zeropp.config.policy import BUCKETS_IN_FLIGHT, bucket_capacity
from zeropp.offload.link import HostLink
from zeropp.partition.unit import Unit
from zeropp.zero.buckets import BucketLayout, GradBuckets
from zeropp.zero.order_check import ARRIVE, EXTRA, REDUCE
from zeropp.zero.state import EngineState


class UnusedParametersError(RuntimeError):
    """Stages 1-2 with ``ignore_unused_parameters: false``: a trainable parameter got no gradient in a backward."""


class GradIntake:
    """Gradients into reduce buckets of ``policy.reduce_bucket_size`` (see the module docstring), reduced into the
    rows of the state's stepped units, the units that train (offloaded rows cross the state's link). It owns the
    bucket layout every rank shares (Note [positional buckets])."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        policy, topo = state.policy, state.topo
        self.buckets = GradBuckets(state, state.shard_world, bucket_capacity(policy.reduce_bucket_size),
                                   state.link if policy.offload_optimizer else HostLink(), direct=topo.world_size == 1)
        self.layout: Optional[BucketLayout] = None  # None: buckets filled in arrival order (stage 3), or no buckets
        self._missing: dict[Unit, int] = {}  # gradients a unit still waits for in this backward
        self._seen: set[tuple[int, int]] = set()  # (unit, slot) whose gradient arrived this backward
        self._window: set[tuple[int, int]] = set()  # (unit, slot) with a gradient in this accumulation window
        self._arrivals: list[tuple[Unit, int]] = []  # this backward's gradients, in arrival order
        self._most_runs: dict[tuple[int, int], tuple[Unit, int, int]] = {}  # in one backward of this window
        self._extras: dict[tuple[int, int], tuple[Unit, int, torch.Tensor]] = {}  # Note [extra gradients]
        self._extras_now: list[tuple[int, int]] = []  # those of this backward
        self._staged: dict[Unit, list[tuple[int, torch.Tensor]]] = {}  # stage 3: leaf units not yet complete
        # Note [arrival order at stage 3]: there the order gradients arrive in decides what each bucket holds
        self._arrival_kind = REDUCE if state.plan.shards_weights else ARRIVE

    def _trainable(self) -> list[tuple[Unit, int]]:
        return [(u, i) for u in self.state.stepped for i, s in enumerate(u.slots) if s.trainable]

    def _ensure_layout(self) -> None:
        """The first layout (Note [positional buckets]): stage 2 the parameters reversed, the order a backward
        usually produces gradients in (a GPT-2's first step filled one bucket at a time; with each unit's
        parameters in their own order, up to 4 at once); stages 0-1 add in unit order at the boundary. Stage 3
        has none (Note [arrival order at stage 3])."""
        plan = self.state.plan
        if self.layout is None and not self.buckets.direct and not plan.shards_weights:
            keys = self._trainable()
            if plan.reduces_as_ready:
                keys = keys[::-1]
            self.layout = BucketLayout(keys, self.buckets.capacity)

    def begin_backward(self) -> None:
        self._missing, self._seen, self._arrivals, self._extras_now, self._staged = {}, set(), [], [], {}
        self._ensure_layout()

    def arrive(self, unit: Unit, slot_index: int, grad: torch.Tensor, whole: bool) -> bool:
        """A parameter's gradient, from its hook, into the buckets; True once every gradient the unit needs is
        in. ``whole``: the unit is a leaf module's, whose gradients stage 3 buckets together (Note [partly used
        units])."""
        self._seen.add((unit.index, slot_index))
        self._window.add((unit.index, slot_index))
        left = (self._missing[unit] if unit in self._missing else unit.needs_grad()) - 1
        self._missing[unit] = left
        if whole and self.state.plan.shards_weights:
            self._staged.setdefault(unit, []).append((slot_index, grad))
            if left > 0:
                return False
            for index, g in self._staged.pop(unit):
                self._add(unit, index, g)
        else:
            self._add(unit, slot_index, grad)
        return left == 0

    def _add(self, unit: Unit, slot_index: int, grad: torch.Tensor) -> None:
        self.state.order.note(self._arrival_kind, unit.index, slot_index)
        if self.layout is not None:  # only a layout follows them (not stage 3's hot path, nor one rank)
            self._arrivals.append((unit, slot_index))
        if not self.buckets.add(self.layout, unit, slot_index, grad):  # Note [extra gradients]
            key = (unit.index, slot_index)
            held = self._extras.get(key)
            summed = grad.float() if held is None else held[2].add_(grad)
            self._extras[key] = (unit, slot_index, summed)
            self._extras_now.append(key)

    def finish_backward(self) -> None:
        """The backward is over: the leaf units still waiting go to the buckets, stages 2-3 reduce the buckets
        (stages 0-1 reduce at the boundary), and stages 1-2 with ``ignore_unused_parameters: false`` check that
        every parameter got its gradient."""
        self._bucket_partly_used()
        plan = self.state.plan
        if plan.reduces_as_ready:  # (stages 0-1 reduce at the boundary: their buckets are not this pass's)
            self.buckets.finish(self.layout)
        runs: dict[tuple[int, int], int] = {}
        for unit, slot in self._arrivals:
            key = (unit.index, slot)
            runs[key] = runs.get(key, 0) + 1
            if runs[key] > self._most_runs.get(key, (unit, slot, 0))[2]:
                self._most_runs[key] = (unit, slot, runs[key])
        order = self.state.order
        for key in sorted(self._extras_now):  # which extra gradients this backward had, checked at the step
            order.note(EXTRA, *key)
        order.note_end(EXTRA)
        order.note_end(self._arrival_kind)
        if not self.state.policy.ignore_unused_parameters and plan.shards_optimizer and not plan.shards_weights:
            self._check_unused()

    def got_in_window(self, unit: Unit, index: int) -> bool:
        """Whether the parameter got a gradient in this accumulation window (by its hook at stages 2-3, in its
        accumulated ``.grad`` at stages 0-1)."""
        if self.state.plan.reduces_as_ready:
            return (unit.index, index) in self._window
        return unit.slots[index].param.grad is not None

    def close_window(self) -> None:
        """The window's step ran: the next gradients open a new window."""
        self._window = set()

    def reduce_extra_gradients(self, arrivals_agree: bool) -> bool:
        """At the step, after the ranks' digests were found to agree on the extra gradients: reduce those (the
        same on every rank, in one order, through buckets of a layout of their own), and let the layout follow the
        last backward where every rank's gradients arrived in one order. True when extra gradients were reduced
        (the rows changed)."""
        reduced = bool(self._extras)
        if reduced:
            held, self._extras = [self._extras[k] for k in sorted(self._extras)], {}
            extra = BucketLayout([(u, s) for u, s, _ in held], self.buckets.capacity, torch.float32)
            for unit, slot, grad in held:
                self.buckets.add(extra, unit, slot, grad)
            self.buckets.finish(extra)
        # (a window with no backward agrees on nothing: its arrivals are empty; stage 3 has no layout)
        if arrivals_agree and self.layout is not None and self.state.plan.reduces_as_ready and self._arrivals:
            self._follow(self._arrivals)
        self._arrivals, self._most_runs = [], {}
        return reduced

    def drop_extras(self) -> None:
        """The step was refused, or the window's gradients dropped: its extra gradients go with it."""
        self._extras, self._arrivals, self._most_runs = {}, [], {}

    def _follow(self, arrivals: list[tuple[Unit, int]]) -> None:
        """The layout becomes ``arrivals`` (repeats kept), then the runs another backward of the window had on
        top of them, then the trainable parameters that got no gradient there, in the layout's order."""
        layout = self.layout
        count: dict[tuple[int, int], int] = {}
        for u, s in arrivals:
            count[(u.index, s)] = count.get((u.index, s), 0) + 1
        arrivals = arrivals + [(u, s) for key, (u, s, most) in sorted(self._most_runs.items())
                               for _ in range(most - count.get(key, 0))]
        got = {(u.index, s) for u, s in arrivals}
        rest = [(u, s) for u, s in self._trainable() if (u.index, s) not in got]
        if layout is not None:
            rank = {k: i for i, k in reversed(list(enumerate(layout.keys)))}
            rest.sort(key=lambda k: rank.get((k[0].index, k[1]), len(rank)))
        keys = arrivals + rest
        if layout is None or tuple((u.index, s) for u, s in keys) != layout.keys:
            self.layout = BucketLayout(keys, self.buckets.capacity)
            # buckets held while gradients came out of layout order: not kept once the layout follows them
            self.buckets.pool.trim(BUCKETS_IN_FLIGHT + 1)

    def _bucket_partly_used(self) -> None:
        """Note [partly used units]: at stage 3 (buckets in arrival order) a leaf module (``set_z3_leaf_modules``,
        ``leaf_module``, the granularity threshold) is one unit over several modules, and ranks may use different
        parts of it: a mixture of experts whose tokens went to other experts on another rank, a forward that picks
        a child by rank. Each rank would hand the buckets only what it used, in its own order, and the ranks'
        buckets would pair different parameters. So a leaf unit's gradients wait until all of them are in; those
        of a leaf unit still waiting when backward ends go to the buckets in slot order, zeros for the parameters
        it did not use, in unit order: the same adds on every rank whose backward reached the same units. (Stages
        0-2 place every gradient by a layout instead: Note [positional buckets].)"""
        for unit in sorted(self._staged, key=lambda u: u.index):
            got = dict(self._staged[unit])
            for index, slot in enumerate(unit.slots):
                if slot.trainable:
                    grad = got.get(index)
                    if grad is None:
                        grad = torch.zeros(slot.param.shape, dtype=self.state.policy.compute_dtype, device=unit.device)
                    self._add(unit, index, grad)
        self._staged = {}

    def _check_unused(self) -> None:
        """Stages 1-2 with ``ignore_unused_parameters: false`` (DeepSpeed's check): every trainable parameter must
        have a gradient after each backward; the ranks agree (one all-reduce), so every rank raises."""
        state = self.state
        arrived = (lambda u, i, s: (u.index, i) in self._seen) if state.plan.reduces_as_ready else \
            (lambda u, i, s: s.param.grad is not None)
        unused = [s.name for u in state.stepped for i, s in enumerate(u.slots)
                  if s.param.requires_grad and not arrived(u, i, s)]
        flags = torch.zeros(state.topo.world_size)
        flags[state.topo.rank] = float(bool(unused))
        state.comm.all_reduce(flags, state.topo.world, Phase.OTHER)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if ranks:
            raise UnusedParametersError(
                f"parameters {unused[:10] or '(on other ranks)'} got no gradient in this backward (rank(s) {ranks}): "
                "they were not used to compute the loss. Set zero_optimization.ignore_unused_parameters to true (the "
                "default) to train on without them, or remove them from the model or from model_parameters")

    def reduce_whole(self) -> None:
        """Stages 0-1, at the boundary: reduce every accumulated full gradient into its shard.

        A trainable parameter without a gradient on this rank contributes zeros (Note [positional buckets]), so
        every rank reduces the same buckets even when some rank's forward skipped a module.
        """
        self._ensure_layout()
        for unit in self.state.units:
            for index, slot in enumerate(unit.slots):
                p = slot.param
                # (one frozen for this micro-step only still has its window's gradient)
                if not slot.trainable or p.grad is None:
                    continue
                grad, p.grad = p.grad, None
                if not self.buckets.add(self.layout, unit, index, grad):
                    raise AssertionError(f"{slot.name}: no place in the reduce buckets")
        self.buckets.finish(self.layout)

    def buffer_bytes(self) -> int:
        """Bytes of the bucket buffers held now (ZeRO-R's buffer report)."""
        return self.buckets.pool.nbytes()
