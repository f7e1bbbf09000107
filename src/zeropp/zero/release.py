"""Stage 3: when a unit's full weights are released (:class:`Releases`), decided in one place.

Note [one owner for release]. Six places see a moment at which a unit might be done with: the end of its
module's forward, the last of its gradients arriving, the end of a span that held it (Note [external reads] in
``param_use.py``), the gradient of a frozen unit's inputs being computed, the sweep at the end of each pass,
and the end of generation's hold. Each only reports its event here; whether the unit goes is decided here from
what holds it:

* it needs a gradient: a frozen unit (or a unit mixing frozen and trainable parameters under NVMe offload) is
  held until its inputs' gradients are computed, since its backward reads its weights for them; a trainable one
  until its gradients are all in (Note [frozen units in backward] in ``partition/unit.py``);
* it is deferred: a running forward holds it (a declared external read, or a learned span);
* the backward is open (a frozen unit's input gradient outside the engine's backward releases nothing);
* the model is held whole (generation: Note [generation gathers] in ``gathers.py``);
* it is kept: a persistent unit gathered from its current shard (Note [persistent units]).

``Gathers.drop`` then releases it through the pass's strategy (hpZ keeps its slice).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from zeropp.partition.unit import Unit, UnitState
from zeropp.zero.gathers import Gathers, Pass, current_pass
from zeropp.zero.spans import Spans
from zeropp.zero.state import EnginePhase, EngineState
from zeropp.zero.watching import unwatched


class Releases:
    """The one part that decides when a unit's full weights are released (Note [one owner for release])."""

    def __init__(self, state: EngineState, gathers: Gathers, spans: Spans) -> None:
        self.state, self.gathers, self.spans = state, gathers, spans

    # ---- events ------------------------------------------------------------------------------------------
    def forward_end(self, unit: Unit, args: Any) -> None:
        """The unit's module finished its forward (its post-forward hook, with the forward's inputs)."""
        state = self.state
        if torch.is_grad_enabled() and (not unit.needs_grad() or unit in state.mixed):
            self._hold_until_inputs_grad(unit, args)
        spans = self.spans
        if spans.holding(unit):  # declared external, or kept by a span already
            return
        span = spans.span_of(unit)
        if span is not None and state.quiet:  # its span's module may run inside compiled code: hold to the end
            return
        if span is not None and spans.running(span):
            spans.hold(span, unit)
            return
        spans.note_release(unit)
        self._release(unit, current_pass(state))

    def gradient_ready(self, unit: Unit) -> None:
        """Every gradient the unit needs in this backward is in (its parameters' hooks)."""
        if unit not in self.state.mixed:  # a mixed unit waits for its inputs' gradients, as a frozen one
            self._release(unit, Pass.BACKWARD)

    def span_end(self, unit: Unit) -> None:
        """The forward that held ``unit`` ended (a span, a declared external read, a direct call)."""
        self._release(unit, current_pass(self.state))

    def frozen_input(self, unit: Unit) -> None:
        """The gradient of every input of a frozen (or mixed) unit's module was computed: its backward is over."""
        if self.state.backward_open:
            self._release(unit, Pass.BACKWARD)

    def sweep(self, which: Pass) -> None:
        """A pass ended: every unit still gathered goes (a unit whose forward raised, a span that never ended)."""
        for unit in self.state.units:
            self._release(unit, which)

    # ---- holding the model whole -------------------------------------------------------------------------
    @contextlib.contextmanager
    def holding_whole(self) -> Iterator[None]:
        """Gather every unit and release none until the block ends (``engine.held_whole()``); collective."""
        held = self.gathers.gather_all()
        self.state.held_whole = True
        try:
            yield
        finally:
            self.state.held_whole = False
            self._free_all(held)

    def stop(self) -> None:
        """Release nothing from now on, and gather nothing now: the units gathered stay (DeepSpeed's hooks taken
        off the model, as TRL's generation does)."""
        self.state.held_whole = True

    def resume(self) -> None:
        """Release as usual again (the units gathered meanwhile go at their next use's end)."""
        self.state.held_whole = False

    @property
    def releasing(self) -> bool:
        return not self.state.held_whole

    def free_everything(self) -> None:
        """Free every gathered unit now, persistent ones included (the next use gathers them again); between passes
        only (``free_gathered``). Below stage 3 the weights are resident, not gathered: nothing to free."""
        state = self.state
        if not state.plan.shards_weights:
            return
        if state.phase is not EnginePhase.IDLE or state.direct or state.held_whole:
            raise RuntimeError("free_gathered (empty_partition_cache): call it between steps, not inside a forward, "
                               "a backward or a GatheredParameters / held_whole block")
        for unit in state.units:
            if unit.state is UnitState.GATHERED:
                self.gathers.free(unit)

    # ---- the decision ------------------------------------------------------------------------------------
    def _release(self, unit: Unit, which: Pass) -> None:
        if unit.state is UnitState.GATHERED and not self.state.held_whole and not self.state.kept.holds(unit):
            self.gathers.drop(unit, which)

    def _free_all(self, units: list[Unit]) -> None:
        """Free what ``gather_all`` gathered (no hpZ slice is cut: no backward follows)."""
        for unit in units:
            if unit.state is UnitState.GATHERED and not self.state.kept.holds(unit):
                self.gathers.free(unit)

    @unwatched
    def _hold_until_inputs_grad(self, unit: Unit, args: Any) -> None:
        """A frozen unit's weights are read by its backward (for its inputs' gradient) and by nothing after:
        release it once the gradient of every input that needs one has been computed."""
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return
        left = [len(inputs)]

        def done(grad: torch.Tensor) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.frozen_input(unit)
        for t in inputs:
            t.register_hook(done)
