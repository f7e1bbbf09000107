"""``optimizer.parameter_offload`` of a stage-3 engine: DeepSpeed's module hooks as TRL reaches them to generate.

TRL's ``unwrap_model_for_generation`` (its GRPO, RLOO and online trainers), with ``ds3_gather_for_generation`` on,
gathers every parameter with ``GatheredParameters`` and then takes DeepSpeed's stage-3 hooks off the model for the
generation (``remove_hooks``: each of ``forward_hooks``/``backward_hooks`` removed, the parameters'
``ds_active_sub_modules`` cleared), so that the many one-token forwards of ``generate`` neither gather nor release
anything; afterwards it puts them back (``add_hooks``: the coordinator's trace invalidated,
``_register_deepspeed_module(module)``).

zeropp's hooks stay registered; what "off" means for them is the engine releasing no gathered unit and gathering
nothing now (``engine.releases.stop()``; ``engine.held_whole()`` does the same after gathering every unit), so
removing the hooks turns that on and ``_register_deepspeed_module`` turns it off again (``releases.resume()``). The state lives in the engine, not in this view, so the view
``add_hooks`` reaches (a new one) undoes what another one did. The coordinator's trace is the engine's learned
gather order (what prefetching follows): invalidating it makes the next pass learn it again.
"""
from __future__ import annotations

from typing import Any, Iterator

from torch import nn

from zeropp.zero.param_use import external_parameters


class _ModuleHooks:
    """The one entry of ``forward_hooks``: removing it takes the engine's gather-and-release off."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def remove(self) -> None:
        self._engine.releases.stop()


class _Coordinator:
    """``param_coordinator``: its trace is the engine's learned gather order."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def is_invalid_trace(self) -> bool:
        return not self._engine.gathers.knows_order

    def _invalidate_trace(self) -> None:
        self._engine.gathers.forget_order()


class _ModuleView:
    """The engine's model as ``parameter_offload.module``: the model's own attributes, plus DeepSpeed's
    ``ds_external_parameters()`` (the parameters declared with ``register_external_parameter``)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def ds_external_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter([(str(id(p)), p) for p in external_parameters(self._module)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` as TRL's generation reaches it (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.module = _ModuleView(engine.module)
        self.forward_hooks: list[Any] = [_ModuleHooks(engine)] if engine.releases.releasing else []
        self.backward_hooks: list[Any] = []
        self.param_coordinator = _Coordinator(engine)

    def _register_deepspeed_module(self, module: Any) -> None:
        """Put the hooks back: the engine gathers and releases per unit again (units gathered now are released
        at their next use's end, or by the ``GatheredParameters`` block around the generation)."""
        self._engine.releases.resume()
        self.forward_hooks = [_ModuleHooks(self._engine)]
