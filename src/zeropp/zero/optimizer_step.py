"""The optimizer step at an accumulation boundary, a part the engine owns (:class:`OptimizerStep`): unscale the
reduced gradient rows, take the global norm (whose all-reduce also carries the collective order check), skip or
clip, step the optimizer on the fp32 master shards (on a thread for the delayed update) and publish the masters as
the next forward's weights. ``ZeroEngine`` decides when and drives one step's three parts in order
(:meth:`OptimizerStep.begin` -> :meth:`StepRun.norm` -> :meth:`StepRun.finish`); between the norm and the update
it may have the gradient intake reduce extra gradients (Note [extra gradients]), and then the norm is taken again.
This part works on the shared state (Note [engine state]) and the weights' part, ``Gathers`` (a unit's 16-bit
shard copied back to its device; stages 0-2: the full weights rebuilt from the shards).
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function  # labels the step's parts in a torch.profiler trace

from zeropp.comm.ledger import Phase
from zeropp.offload.row_norm import squared_norm
from zeropp.partition.unit import Unit
from zeropp.zero.background import BackgroundUpdate
from zeropp.zero.gathers import Gathers
from zeropp.zero.loss_scaler import LossScaler
from zeropp.zero.order_check import NormCheck
from zeropp.zero.state import EngineState

log = logging.getLogger("zeropp")
Masters = list[tuple[str, torch.Tensor]]  # (parameter name, its fp32 master view): what an optimizer is built over


class OptimizerStep:
    """The step on the master shards of the state's stepped units (see the module docstring)."""

    def __init__(self, state: EngineState, optimizer: torch.optim.Optimizer, scheduler: Any, gathers: Gathers) -> None:
        self.state = state
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.gathers = gathers
        # master views the optimizer updates (frozen or left-out parameters are not among them)
        self.optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        s = state.policy.loss_scaling  # fp16 only
        self.loss_scaler = LossScaler.from_config(s.loss_scale, s.initial_scale_power, s.window, s.hysteresis,
                                                  s.min_scale) if s is not None else None
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient
        self.skipped = False  # the last step was skipped
        self.global_grad_norm: Optional[float] = None
        self._update: Optional[BackgroundUpdate] = None
        self._host_grads: Optional[torch.Tensor] = None  # Note [host step passes]

    @classmethod
    def build(cls, state: EngineState, make_optimizer: Callable[[Masters], torch.optim.Optimizer],
              make_scheduler: Callable[[torch.optim.Optimizer], Any], trainable: Optional[set[int]],
              gathers: Gathers) -> "OptimizerStep":
        """The step over an optimizer of the fp32 master views of the trainable parameters (``trainable``: their
        ids, None for all), and its schedule."""
        masters = [
            (slot.name, view)
            for u in state.stepped
            for slot, view in zip(u.slots, u.master_views())
            if slot.param.requires_grad and (trainable is None or id(slot.param) in trainable)
        ]
        optimizer = make_optimizer(masters)
        step = cls(state, optimizer, make_scheduler(optimizer), gathers)
        state.residency.attach(optimizer, step.optimized)
        return step

    @property
    def keeps_rows(self) -> bool:
        """Whether the reduced gradient rows stay allocated between steps (Note [rows between steps])."""
        return self.state.plan.shards_weights and all(u.state_device.type == "cpu" for u in self.state.stepped)

    def drop_gradients(self) -> None:
        """Drop the accumulated gradients: the whole ones of stages 0-1 and the reduced rows of stages 2-3 (the
        engine drops the gradient intake's extra gradients beside them)."""
        for u in self.state.stepped:
            for slot in u.slots:
                slot.param.grad = None
        self.clear_rows()

    def clear_rows(self) -> None:
        """The reduced gradient rows are done with: zeroed where they stay, freed elsewhere."""
        self.state.residency.clear_grads(self.state.stepped, keep_rows=self.keeps_rows)

    def begin(self, background: bool = False) -> "StepRun":
        """Start a step: unscale, then :meth:`StepRun.norm` and :meth:`StepRun.finish`.

        ``background`` (delayed parameter update): the update runs on a thread and is published by the
        next :meth:`join_update`; the norm's collective stays on this thread, so every rank issues its
        collectives in the same order whatever the thread's timing.

        Two passes over the gradient rows (the norm, then the update), each through the residency: with
        NVMe, a unit's row, master and optimizer state are in memory only while that unit is processed.
        """
        with self.state.timer.span("offload_io"):
            self.state.link.wait_uploads()  # the host rows are written below: no upload may still read them
        return StepRun(self, background)

    def _group_buffer(self, group: list[Unit]) -> dict[Unit, torch.Tensor]:
        """Slices of an fp32 buffer for the 16-bit gradient rows of ``group`` (Note [host step passes]): on the
        host one buffer kept between steps, grown to the largest group once; on an accelerator a fresh one."""
        units = [u for u in group if u.grad_row().dtype != torch.float32]
        size = sum(u.row.numel for u in units)
        if not units:
            return {}
        device = units[0].grad_row().device
        if device.type != "cpu":  # an accelerator's allocator reuses memory without faults; kept, the buffer would
            buffer = torch.empty(size, dtype=torch.float32, device=device)  # sit there through the next backward
        else:
            if self._host_grads is None or self._host_grads.numel() < size:
                self._host_grads = None  # freed before its successor is made
                self._host_grads = torch.empty(size, dtype=torch.float32, device=device)
            buffer = self._host_grads
        out, at = {}, 0
        for u in units:
            out[u] = buffer[at : at + u.row.numel]
            at += u.row.numel
        return out

    def _step_group(self, units: list[Unit]) -> set[Unit]:
        """``optimizer.step()``; returns the units whose 16-bit shard it also wrote. A host optimizer with
        ``step_and_copy`` (CpuAdam) writes the recast of a shard that sits beside its master in the same pass
        over memory (ZeRO-Offload's copy-back), instead of a second pass reading every master again."""
        copy = getattr(self.optimizer, "step_and_copy", None)
        out16: dict[torch.Tensor, torch.Tensor] = {}
        fused: set[Unit] = set()
        if copy is not None:
            for u in units:
                views = u.host_shard_views()
                # a view the optimizer does not step would keep whatever the shard held: recast those units
                if views is not None and all(id(v) in self.optimized for v in u.master_views()):
                    out16.update(zip(u.master_views(), views))
                    fused.add(u)
        if out16:
            copy(out16)
        else:
            self.optimizer.step()
        return fused

    @staticmethod
    def _set_master_grads(units: list[Unit], fp32_grad: Callable[[Unit], torch.Tensor],
                          coef: Optional[float]) -> None:
        """Point each master view's ``.grad`` at its slice of the unit's fp32 gradient (clipped by ``coef``)."""
        for u in units:
            g = fp32_grad(u)
            if coef is not None:
                g.mul_(coef)
            for view, o, c in zip(u.master_views(), u.row.offsets, u.row.chunks):
                view.grad = g[o : o + c]

    def _note_overflow(self, overflow: bool) -> None:
        """fp16: an overflow is the normal signal to lower the loss scale, not an error."""
        assert self.loss_scaler is not None
        before = self.loss_scaler.scale
        self.loss_scaler.update(overflow)
        if overflow and self.state.topo.rank == 0:
            log.warning("fp16 gradient overflow: step %d skipped, loss scale %g -> %g",
                        self.state.global_steps, before, self.loss_scaler.scale)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when not training in fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def grad_unscale(self) -> float:
        """What turns a reduced gradient row into the step's gradient: the fp16 loss scale out, and the
        reduction's pre-division (``gradient_predivide_factor``) and mean (``gradient_allreduce_op``) settled:
        rows hold ``sum / (W * predivide)``, the step wants the mean or, with ``sum``, the sum."""
        policy = self.state.policy
        post = policy.grad_predivide * (self.state.topo.world_size if policy.grad_sum else 1)
        return post / self.loss_scale

    def _apply_update(self) -> None:
        """The optimizer and scheduler step on the fp32 masters (no collective: may run on a thread)."""
        self.optimizer.step()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        if self.scheduler is not None:
            self.scheduler.step()

    def publish_masters(self, phase: Phase, units: list[Unit]) -> None:
        """Make the masters of ``units`` the weights: recast the 16-bit shards, bump versions (stale hpZ
        slices), and in stages 0-2 rebuild the resident full weights. Collective for stages 0-2."""
        state = self.state
        state.link.wait_uploads()  # the staged rows are rewritten below
        for u in units:
            with state.residency.resident([u]):
                u.refresh_shard_from_master()
                self.gathers.copy_back(u)
        if not state.plan.shards_weights:
            self.gathers.gather_resident(phase)

    def join_update(self) -> None:
        """Wait for a delayed update still running and publish it; a no-op when none is pending.

        Collective (every rank calls it at the same points): weight loads, state-dict and checkpoint calls
        and the next optimizer step call it first.
        """
        self.state.link.wait_uploads()  # callers write the masters next: no upload may still read them
        if self._update is None:
            return
        update, self._update = self._update, None
        update.wait()
        self.publish_masters(Phase.FORWARD_GATHER, self.state.stepped)  # a step leaves frozen units as they were
        self.state.link.wait_uploads()

    def _report_non_finite(self) -> None:
        bad = []
        for u in self.state.stepped:
            with self.state.residency.resident([u], dirty=False):
                bad += [s.name for s, g in zip(u.slots, u.grad_views()) if not torch.isfinite(g).all()]
        where = f"non-finite gradient shard on rank {self.state.topo.rank} in: {', '.join(bad)}" if bad else (
            "non-finite gradient on another rank")
        warnings.warn(f"step {self.state.global_steps} skipped: global gradient norm is not finite ({where})",
                      RuntimeWarning, stacklevel=3)


class StepRun:
    """One optimizer step in progress (:meth:`OptimizerStep.begin`): the unscaled fp32 gradients it reads, the norm
    it took, the update it makes. Its norm and its update read each gradient row through the same conversion, so
    a row is converted once where the residency keeps it in memory between the two passes."""

    def __init__(self, step: OptimizerStep, background: bool) -> None:
        self.step, self.background = step, background
        self.unscale = step.grad_unscale
        self.cache: dict[Unit, torch.Tensor] = {}
        # Note [host step passes]: the host's groups convert into one reused buffer (a delayed update: all of its
        # units, read by its thread until the next step joins it), and the norm reads each row once (Note [row norm])
        self.in_groups = not step.state.residency.caches_grads
        self.into: dict[Unit, torch.Tensor] = {}  # the current group's slices of the reused buffer
        self.device = step.state.stepped[0].device if step.state.stepped else None

    def fp32_grad(self, u: Unit) -> torch.Tensor:
        # .float() of an fp32 row is the row itself, which is zeroed below while a background update may
        # still read its gradients: copy then. Rows that leave memory are recomputed, identically.
        g = self.cache.get(u)
        if g is None:
            row = u.grad_row()
            g = self.into[u].copy_(row) if u in self.into else row.to(torch.float32, copy=self.background)
            if self.unscale != 1.0:
                g.mul_(self.unscale)
            if self.step.state.residency.caches_grads:
                self.cache[u] = g
        return g

    def _sq_norm(self, u: Unit) -> torch.Tensor:  # Note [row norm]: the same sum whichever row it reads
        return squared_norm(u.grad_row(), self.unscale) if self.in_groups else squared_norm(self.fp32_grad(u))

    def _sum_squares(self) -> torch.Tensor:
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for group in self.step.state.residency.grad_pass(self.step.state.stepped):  # squared norms summed in fp64
            for u in group:
                sq += self._sq_norm(u)
        return sq

    def norm(self) -> NormCheck:
        """The gradients' global L2 norm from each unit's squared norm (fp64); the same all-reduce carries the
        ranks' digests of this step's collectives (Note [collective order]), checked before any gradient is used:
        raises ``CollectiveOrderError`` when they differ (the engine then drops the step's gradients)."""
        state = self.step.state
        with record_function("zeropp.grad_norm"):
            sq = self._sum_squares()
            if state.shard_world == 1:  # stage 0 holds whole gradients, identical on every rank, and reduced them
                state.order.reset()     # at the boundary in a fixed order
                return NormCheck(math.sqrt(sq.item()), None)
            both = torch.cat([sq, torch.tensor(state.order.payload(), dtype=torch.float64, device=self.device)])
            state.comm.all_reduce(both, state.topo.world, Phase.OTHER)
            arrivals_agree = state.order.check(both[1:].tolist(), state.topo.world_size)
            return NormCheck(math.sqrt(both[0].item()), arrivals_agree)

    def norm_again(self) -> float:
        """The norm once more, after extra gradients were reduced into the rows (Note [extra gradients])."""
        state = self.step.state
        with record_function("zeropp.grad_norm"):
            self.cache.clear()
            sq = self._sum_squares()
            state.comm.all_reduce(sq, state.topo.world, Phase.OTHER)
            return math.sqrt(sq.item())

    def finish(self, norm: float, schedule: bool = True) -> None:
        """Skip or clip by ``norm``, then update the masters (and, with ``schedule``, step the learning-rate
        schedule)."""
        step, state = self.step, self.step.state
        step.global_grad_norm = norm
        step.skipped = not math.isfinite(norm)
        step.skipped_steps += step.skipped
        if step.loss_scaler is not None:
            step._note_overflow(step.skipped)
        elif step.skipped:
            step._report_non_finite()
        if not step.skipped:
            clip = state.policy.gradient_clipping
            coef = clip / (norm + 1e-6) if clip > 0 and norm > clip else None
            if self.background:
                self.into = step._group_buffer(state.stepped) if self.in_groups else {}
                step._set_master_grads(state.stepped, self.fp32_grad, coef)
                step._update = BackgroundUpdate(step._apply_update)
            else:
                for group in state.residency.optimizer_pass(state.stepped):
                    with record_function("zeropp.grads_to_fp32"):
                        self.into = step._group_buffer(group) if self.in_groups else {}
                        step._set_master_grads(group, self.fp32_grad, coef)
                    with record_function("zeropp.optimizer_update"):
                        fused = step._step_group(group)
                    with record_function("zeropp.copy_back"):
                        for u in group:
                            for view in u.master_views():
                                view.grad = None
                            u.refresh_shard_from_master(recast=u not in fused)
                            step.gathers.copy_back(u)
                if step.scheduler is not None and schedule:
                    step.scheduler.step()
                if not state.plan.shards_weights:
                    step.gathers.gather_resident(Phase.FORWARD_GATHER)  # the next forward's weights
        # the optimizer held its own fp32 copies; rows are kept between steps only in stage 3 on the host (Note
        # [rows between steps])
        step.clear_rows()


# Note [rows between steps]: stage 3 reduces each gradient into its unit's row as backward goes, so the rows are
# needed from the first backward of a window to its step. On the host (optimizer offload, or a CPU run) they stay
# allocated between steps, zeroed: made afresh, they would be paged in again every step. On an accelerator they
# are freed after the step, so that the next forward's activations can use that memory (2 bytes a parameter in
# 16-bit training: 2.5 GB of a 1.24B model's, held through its activation peak); its allocator gives them back
# at the next backward without a fault, zeroed as a kept row would be. Stages 0-2 hold no rows between steps.

# Note [host step passes]: with the optimizer on the host (in groups of ``sub_group_size``: Note [host step in
# groups] in offload/residency.py), the step read each 16-bit gradient row three times and allocated 16 fresh
# bytes per parameter: an fp32 copy for the norm, an fp64 copy inside ``vector_norm``, and another fp32 copy for
# the update, all freed again. The host pays for fresh memory in page faults (a 200M model on this 2-core VM:
# 16 B/parameter of faults a step, the step 1.2-2.5 s, of which Adam itself 0.14 s), and a 1.24B model's
# offloaded step took 6.4 s on an H200's host against DeepSpeed's 1.8 s. Now the norm reads the 16-bit rows
# without a temporary (Note [row norm] in offload/row_norm.py), and the update converts each group into one fp32
# buffer kept between steps (the size of the largest group: memory the conversion took at its peak anyway; on an
# accelerator the buffer is made each step, as kept it would sit in device memory through the next backward). A
# delayed update converts all its units at once into that buffer, which its thread reads until the next step
# joins it (334M Llama with DPU on this VM: fresh pages 15.8 -> 0.1 B/parameter a step, the step call 2.52 -> 0.58 s).
