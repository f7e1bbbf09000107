"""Stage 3's hooks on the model (:class:`ModuleHooks`): a unit's module gathers it before its forward and hooks
its outputs for the backward's gather; every parameter hands its gradient to the intake as it is accumulated.
The hooks report what they see to the parts that decide: gathers (``zero/gathers.py``), releases
(``zero/release.py``), spans (``zero/spans.py``), the gradient intake (``zero/grad_intake.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zeropp.partition.unit import Unit, UnitState
from zeropp.zero import compiled as compiled_regions
from zeropp.zero.gathers import Gathers, Pass, current_pass
from zeropp.zero.grad_intake import GradIntake
from zeropp.zero.param_use import ParamUse
from zeropp.zero.release import Releases
from zeropp.zero.spans import Spans
from zeropp.zero.state import EngineState
from zeropp.zero.watching import unwatched


class ModuleHooks:
    """The engine's hooks on the model's modules and parameters; :meth:`remove` takes them all off."""

    def __init__(self, state: EngineState, gathers: Gathers, releases: Releases, spans: Spans,
                 use: Optional[ParamUse], grads: GradIntake) -> None:
        self.state, self.gathers, self.releases, self.spans = state, gathers, releases, spans
        self.use, self.grads = use, grads
        self.handles: list[RemovableHandle] = []

    def attach(self, unit: Unit, module: nn.Module, whole: bool) -> None:
        """Hook ``unit`` (of ``module``): stage 3's gathers around the module's forward, and the gradient hooks of
        its trainable parameters at stages 2-3. ``whole``: the unit is a leaf module's (Note [partly used
        units] in ``grad_intake.py``)."""
        plan = self.state.plan
        if plan.shards_weights:
            self.handles += [module.register_forward_pre_hook(self._pre_forward(unit)),
                             module.register_forward_hook(self._post_forward(unit))]
        for slot_index, slot in enumerate(unit.slots):
            if slot.param.requires_grad and plan.reduces_as_ready:
                self.handles.append(slot.param.register_post_accumulate_grad_hook(
                    self._grad_hook(unit, slot_index, whole)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre_forward(self, unit: Unit) -> Callable:
        @compiled_regions.eager
        @unwatched
        def hook(module: nn.Module, args: Any) -> None:
            state = self.state
            current = current_pass(state)
            again = (self.use is not None and current is Pass.FORWARD and unit.state is UnitState.SHARDED
                     and self.spans.released_in_this_pass(unit))
            self.gathers.gather(unit, current)
            if again:  # a module called twice: keep it for the second call next time
                self.spans.learn(unit, unit.module_name, state.direct)
        return hook

    def _post_forward(self, unit: Unit) -> Callable:
        @compiled_regions.eager
        @unwatched
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            use = self.use
            assert use is not None  # stage 3, whose units have these hooks, watches its reads
            # gathered again before the module's backward, frozen or not: what autograd saved of the weights may
            # have been packed by another library's saved-tensor hooks (Note [frozen units in backward])
            if torch.is_grad_enabled() and (unit.needs_grad() or use.backward_reads(module, unit, args)):
                self._hook_outputs_for_backward(unit, output)
            self.releases.forward_end(unit, args)
        return hook

    def _hook_outputs_for_backward(self, unit: Unit, output: Any) -> None:
        def on_output_grad(grad: torch.Tensor) -> torch.Tensor:
            if unit.state is UnitState.SHARDED:
                self.gathers.gather(unit, Pass.BACKWARD)
            return grad

        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_output_grad)

    def _grad_hook(self, unit: Unit, slot_index: int, whole: bool) -> Callable:
        @unwatched
        def hook(param: nn.Parameter) -> None:
            grad, param.grad = param.grad, None
            if self.grads.arrive(unit, slot_index, grad, whole) and self.state.plan.shards_weights:
                self.releases.gradient_ready(unit)
        return hook
