"""Accumulation windows and optimizer steps (:class:`Stepping`): where the engine is (the one writer of the state's
``phase`` and ``quiet``: Note [engine state]), which ``step()`` closes a window, the end of a backward, and the
optimizer step driven through its parts in order: the whole gradients reduced (stages 0-1), the
norm whose all-reduce checks the collective order, extra gradients (Note [extra gradients]), the update, the
gather groups formed again, the step's books closed.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from zeropp.partition.unit import check_requires_grad
from zeropp.zero.gathers import Gathers, Pass
from zeropp.zero.grad_intake import GradIntake
from zeropp.zero.memory import ActivationMeter
from zeropp.zero.optimizer_step import OptimizerStep
from zeropp.zero.order_check import CollectiveOrderError
from zeropp.zero.release import Releases
from zeropp.zero.state import EnginePhase, EngineState
from zeropp.zero.timing import format_time_report
from zeropp.zero.watching import unwatched


class Stepping:
    """The engine's ``step()`` and its accumulation window (see the module docstring)."""

    def __init__(self, state: EngineState, stepper: OptimizerStep, grads: GradIntake, gathers: Gathers,
                 releases: Releases, activations: ActivationMeter) -> None:
        self.state, self.stepper, self.grads = state, stepper, grads
        self.gathers, self.releases, self.activations = gathers, releases, activations
        self._boundary_override: Optional[bool] = None  # force_boundary()
        self._restart_pending = False  # restart_accumulation(): the next backward drops the gradients first
        self.step_applied = False  # the last step() updated the weights

    def is_boundary(self) -> bool:
        """Whether the next ``step()`` steps the optimizer: every ``gradient_accumulation_steps`` micro-steps,
        unless :meth:`force_boundary` said otherwise (an epoch's last, shorter window)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.state.micro_steps + 1) % self.state.policy.gradient_accumulation_steps == 0

    def force_boundary(self, is_boundary: Optional[bool]) -> None:
        """Make the next ``step()`` calls step the optimizer (True) or only accumulate (False) whatever the
        micro-step count says, until called with None; the engine counts such a window as a whole one."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"the accumulation boundary is True, False or None, got {is_boundary!r}")
        self._boundary_override = is_boundary

    def restart_accumulation(self) -> None:
        """Make the next ``backward`` start a new accumulation (DeepSpeed's ``optimizer.zero_grad()``): the
        gradients accumulated since the last optimizer step are dropped as it begins. Until then they stay as they
        are, readable and steppable, as DeepSpeed keeps them."""
        self._restart_pending = True

    @contextlib.contextmanager
    def running(self, phase: EnginePhase, quiet: bool) -> Iterator[None]:
        """The engine is in ``phase`` (``quiet``: running compiled code without watches) inside the block."""
        state = self.state
        state.phase, state.quiet = phase, quiet
        try:
            yield
        finally:
            state.phase, state.quiet = EnginePhase.IDLE, False

    def begin_backward(self, quiet: bool) -> None:
        """A backward starts (``quiet``: of compiled code, without watches); :meth:`finish_backward` ends it. The
        gradients go first if :meth:`restart_accumulation` asked for it."""
        if self._restart_pending:
            self.stepper.drop_gradients()
            self.grads.drop_extras()  # (Note [extra gradients]: every rank drops the same ones)
            self._restart_pending = False
        self.state.phase, self.state.quiet = EnginePhase.BACKWARD, quiet

    @unwatched
    def finish_backward(self) -> None:
        """The backward is over: its gradients reduced, its prefetches drained, every unit released."""
        state = self.state
        try:
            self.grads.finish_backward()
            if state.plan.shards_weights:
                self.gathers.drain(Pass.BACKWARD)
                self.releases.sweep(Pass.BACKWARD)
        finally:
            state.phase, state.quiet = EnginePhase.IDLE, False
        state.strategies.backward_gather.check_deferred()

    def finish_open_backward(self) -> None:
        """Close a backward still open (its gradients reduced); nothing when none is."""
        if self.state.backward_open:
            self.finish_backward()

    @unwatched  # the engine's own work: no torch-function mode need see the optimizer's calls
    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, step the optimizer on the master shards."""
        state = self.state
        boundary = self.is_boundary()
        scale_before = self.stepper.loss_scale
        with state.timer.span("optimizer"):  # all of this call's work is in a span: untracked is the caller's
            # unfrozen since initialize: refused; frozen: refused at the boundary if it got no gradient in the window
            check_requires_grad(state.units, self.grads.got_in_window if boundary else None)
            self.step_applied = False
            if state.backward_open:
                with state.timer.span("backward"):
                    self.finish_backward()
            state.micro_steps += 1
            if not boundary:
                return
            # a shorter window (a boundary set by hand) counts as a whole one, so that micro-steps stay a multiple
            # of the accumulation at every boundary, as checkpoints expect
            gas = state.policy.gradient_accumulation_steps
            state.micro_steps = -(-state.micro_steps // gas) * gas
            after = state.policy.delayed_update_after
            self._step_window(delayed=after is not None and state.global_steps >= after)
            self.step_applied = not self.stepper.skipped
        state.global_steps += 1
        self._close_step(scale_before)
        if state.policy.print_every and state.global_steps % state.policy.print_every == 0 and state.topo.rank == 0:
            print(f"[zeropp] {format_time_report(state.timer.report(), state.global_steps)}", flush=True)

    def _close_step(self, scale_before: float) -> None:
        """The step's books: the reduce strategy's end of step, the ledger's, the timer's and the meters'."""
        state = self.state
        state.strategies.reduce.end_step(self.stepper.loss_scale / scale_before)
        state.ledger.close_step()
        state.timer.close_step()
        self.activations.close_step()
        state.budget.close_step()

    def _step_window(self, delayed: bool, schedule: bool = True) -> None:
        """The optimizer step that closes an accumulation window (stages 0-1 reduce their whole gradients
        first); ``schedule=False`` leaves the learning-rate schedule where it is."""
        state = self.state
        if not state.plan.reduces_as_ready:
            self.grads.reduce_whole()
        if delayed:
            self.stepper.join_update()  # the previous step's update becomes the next forward's weights
        with self.running(EnginePhase.STEP, quiet=False):
            run = self.stepper.begin(background=delayed)
            try:
                check = run.norm()  # raises if the ranks' collectives differed
            except CollectiveOrderError:
                self.stepper.clear_rows()  # mixed: never used
                self.grads.drop_extras()
                raise
            norm = check.norm
            if check.arrivals_agree is not None and self.grads.reduce_extra_gradients(check.arrivals_agree):
                norm = run.norm_again()
            run.finish(norm, schedule=schedule)
            if state.plan.shards_weights:
                self.gathers.regroup(check)  # from gathers the step's check found the same on every rank
        self.grads.close_window()
        self._restart_pending = False  # the step cleared the gradients

    @unwatched
    def step_now(self) -> None:
        """Step the optimizer on the gradients accumulated so far, whatever the micro-step count (DeepSpeed's
        ``engine.optimizer.step()``). The step counters and the learning-rate schedule do not advance: that is
        ``step()``'s part. Collective, as a boundary's step."""
        scale_before = self.stepper.loss_scale
        with self.state.timer.span("optimizer"):
            self.finish_open_backward()
            self.stepper.join_update()
            self._step_window(delayed=False, schedule=False)
        self.state.strategies.reduce.end_step(self.stepper.loss_scale / scale_before)

    def restart_counts(self) -> None:
        """Count micro-steps and optimizer steps from 0 again, keeping the weights, the optimizer's state and
        the schedule: a new run over the trained model (a Trainer's second ``train()``), whose checkpoints are
        then tagged with its own step numbers. Only between steps, at an accumulation boundary."""
        state = self.state
        gas = state.policy.gradient_accumulation_steps
        if state.backward_open or state.micro_steps % gas:
            raise RuntimeError(f"restart_counts: inside an accumulation window ({state.micro_steps % gas} of {gas} "
                               "micro-steps taken); call it after the window's step()")
        self.stepper.join_update()  # a delayed update lands before the counters stop saying one is pending
        state.micro_steps = state.global_steps = 0
