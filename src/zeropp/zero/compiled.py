"""``torch.compile`` around a stage-3 model: what the engine does so that compiled code sees only the model.

Note [compiled regions]: the engine gathers and releases units in module hooks, serves external reads through
a ``TorchFunctionMode`` and saved-tensor hooks, and refuses reads between passes through another mode. Traced
by Dynamo, each of these would either break the graph at every torch call or guard on state that changes
every step (the engine's dictionaries, a parameter's storage), so the model would recompile at every call.
So:

* the engine's unit hooks are ``torch.compiler.disable``d: Dynamo breaks the graph there and runs them
  eagerly, so each unit's gather and release stay at its boundary, and a unit's compiled code only ever
  runs on gathered weights (``block.compile()`` gives one graph per block, between its two hooks);
* the first optimizer step runs eagerly (``torch.compiler.set_stance("force_eager")``) with every watch on,
  which learns the spans of external reads (Note [external reads] in ``param_use.py``);
* from then on the passes run with torch-function handling off and without the saved-tensor hooks, so no
  mode is traced, and ``ParamUse``'s per-module hooks return at once under Dynamo. A unit that a learned
  span keeps gathered outside its own forward is held until the forward ends, and gathered before backward
  begins (a compiled graph saves the weight itself, with no hook to gather it when backward reads it).

Released weights keep their tensors and only lose their storage (``ParamSlot.free``), and a gather refills
the same storage, so what a compiled forward saved for backward is valid again once its unit is gathered.

A model compiled whole before ``initialize`` (``torch.compile(model)``, an ``OptimizedModule``) is unwrapped:
the engine holds the model itself, so parameter names, checkpoints and state dicts carry no ``_orig_mod.``,
and calls the compiled wrapper for its forward.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from zeropp.partition.assign import outer_block_names


def unwrap(model: nn.Module) -> tuple[nn.Module, Optional[Callable[..., Any]]]:
    """``(the model, its compiled wrapper)`` for a model compiled whole, else ``(model, None)``."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, model
    return model, None


def compiled_parts(module: nn.Module) -> bool:
    """Whether some module of ``module`` was compiled in place (``module.compile()``)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly even when called from compiled code (a graph break around it)."""
    return torch.compiler.disable(fn, recursive=True)


def force_eager() -> Any:
    """A context in which compiled functions run their original, eager code."""
    return torch.compiler.set_stance("force_eager")


def without_backend(compile_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``engine.compile``'s ``compile_kwargs`` less a ``backend``, which the argument of its own overrides (with a
    warning)."""
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        warnings.warn("engine.compile: the backend in compile_kwargs is overridden by the backend argument",
                      stacklevel=3)
        del kwargs["backend"]
    return kwargs


def compile_model(model: nn.Module, backend: Any = "inductor", kwargs: Optional[dict[str, Any]] = None
                  ) -> list[nn.Module]:
    """Compile ``model`` in place, one compiled region per block (the children of its ``nn.ModuleList``s, the
    default gather units), or the whole model when it has none; returns the modules compiled.

    A region per block keeps the gathers at the block boundaries, so one block's gather overlaps the previous
    block's compiled compute (Note [compiled regions]); modules outside the blocks (embeddings, the final norm)
    stay eager, as torchtitan leaves them.
    """
    from torch._dynamo.exc import InvalidBackend

    modules = dict(model.named_modules())
    targets = [modules[n] for n in outer_block_names(model)] or [model]
    try:
        for module in targets:
            module.compile(backend=backend, **(kwargs or {}))
    except InvalidBackend as err:
        import torch._dynamo

        raise ValueError(f"compile backend {backend!r}: torch.compile does not know it; known: "
                         f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}") from err
    return targets
