"""Stage 3: a clear error, not a crash, when a partitioned parameter is read between the engine's passes.

Note [reads between passes]: between the engine's forward and backward (where the loss is computed), and
between a step and the next forward (logging, an EMA of the weights, ``copy.deepcopy(model)``), a stage-3
parameter keeps its shape but has no storage: its unit is released. A torch op that reads its elements
would read through a null pointer and kill the process with a segmentation fault, no message, no traceback.
Serving such reads by gathering there and then (as Note [external reads] does inside the passes) would be
wrong here: a read made on one rank only (``if rank == 0: print(w.norm())``) would issue a collective the
other ranks never join and hang the job. So they are refused, by name, with the calls that do work.

One ``TorchFunctionMode`` per thread that built a stage-3 engine sits at the *bottom* of torch's
function-mode stack (put there under any modes already on it) for as long as an engine that watches is
alive. At the bottom, the ``with`` blocks of other modes (``torch.device``, profilers) entered before or
after it push and pop above it in their own order, whenever the engine's passes begin or end. During a
pass the engine's own watch (:class:`~zeropp.zero.param_use.ParamUse`) sits above it and serves reads; the
engine's own work runs with torch-function handling off (``unwatched``). The check costs one Python call
per torch call made outside the passes; :meth:`ZeroEngine.close` takes the mode off the stack once no
engine needs it.

Note [watches stay on]: torch takes a mode off its stack while the mode's own handler runs, and a handler
that calls ``func(*args)`` runs all of ``func`` without it. Most torch functions are native and make no
further torch calls, but some run Python that does: ``Tensor.backward`` and ``torch.autograd.grad`` run the
whole backward (gradient hooks, custom ``autograd.Function`` backwards, and the forwards that activation
checkpointing recomputes), ``torch.utils.checkpoint`` and the Python functionals run more torch calls. The
engine's backward enters autograd through ``Tensor.backward``, so a watch that called ``func`` directly was
off for every backward: a recomputed forward read a released frozen weight through a native kernel and the
process died with SIGSEGV. So both watches (this one and ``ParamUse``'s) call ``func`` with themselves pushed
back on the stack and one level of dispatch skipped (``torch.overrides.redispatch_function``): no torch call
made while a watch is installed runs without it, whatever Python the call runs inside (on a torch before 2.13,
inside the backward only: Note [torch without one-hop skip]).

An alias made while the weights were gathered (``d = w.detach()`` inside a forward, read after it) is seen
too: its storage is the released unit's (Note [released storage] in ``partition/unit.py``). What is still not
seen: native code reached with torch functions disabled, and reads from threads other than the one that built
the engine (the mode stack is per thread).
"""
from __future__ import annotations

import threading
import weakref
from types import FunctionType
from typing import Any, Optional, Protocol

import torch
from torch.overrides import TorchFunctionMode


class _Watcher(Protocol):
    def check_idle(self, func: Any, args: tuple, kwargs: dict) -> None: ...


_LOCK = threading.Lock()
# the watchers, weakly: a tuple remade when one comes or goes, because every torch call reads it (iterating a
# WeakSet on every call took about 1.5% of a launch-bound step); a watcher collected unwatched reads as None
_WATCHERS: tuple["weakref.ref[Any]", ...] = ()


def _live_except(watcher: Any) -> tuple["weakref.ref[Any]", ...]:
    """The references to watchers still alive, ``watcher``'s left out (call with ``_LOCK`` held)."""
    return tuple(ref for ref in _WATCHERS if ref() is not None and ref() is not watcher)


class _IdleMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # code compiled outside the engine: traced as a plain call, no guards
            return func(*args, **kwargs)   # on the watchers (Note [compiled regions] in compiled.py)
        for ref in _WATCHERS:
            watcher = ref()
            if watcher is not None:
                watcher.check_idle(func, args, kwargs)
        return run_watched(self, func, types, args, kwargs)


_REDISPATCH = threading.local()  # .func: the Python function whose dispatch is being skipped on this thread


def run_watched(mode: TorchFunctionMode, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """Call ``func`` from ``mode``'s handler with ``mode`` back on the stack (Note [watches stay on])."""
    pending = getattr(_REDISPATCH, "func", None)
    _REDISPATCH.func = None
    if not isinstance(func, FunctionType) or pending is func:
        # native: nothing inside it makes torch calls. ``pending is func``: the skipped hop went to another
        # call, so ``func`` came back here; it runs as torch runs any handler's call, without the mode
        return func(*args, **kwargs)
    skip_one_hop = getattr(torch.overrides, "redispatch_function", None)
    if skip_one_hop is None:  # Note [torch without one-hop skip]
        return _run_watched_before_skip(mode, func, args, kwargs)
    _REDISPATCH.func = func
    try:
        with mode:
            return skip_one_hop(func, types, args, kwargs)
    finally:
        _REDISPATCH.func = None


# Note [torch without one-hop skip]: ``torch.overrides.redispatch_function`` (torch 2.13) is what keeps a watch on
# inside a Python-bodied torch function. Without it there is no way back into such a function's body with the
# mode on the stack (its first line would hand the call to the mode again), so on an older torch the body runs
# as torch runs any handler's call: unwatched. Except the backward, which matters most (activation checkpointing
# recomputes forwards inside it, Note [watches stay on]): ``Tensor.backward`` and ``torch.autograd.backward`` are
# run through autograd's engine entry with the mode on the stack, as their own bodies would.
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)
# their arguments in order (the same for both; Tensor.backward calls the second one ``gradient``)
_BACKWARD_ARGS = ("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs")


def _run_watched_before_skip(mode: TorchFunctionMode, func: Any, args: tuple, kwargs: dict) -> Any:
    if func in _BACKWARDS and "grad_variables" not in kwargs and len(args) <= len(_BACKWARD_ARGS):
        bound = dict(zip(_BACKWARD_ARGS, args), **{"grad_tensors" if k == "gradient" else k: v
                                                   for k, v in kwargs.items()})
        with mode:
            return _engine_backward(bound["tensors"], bound.get("grad_tensors"), bound.get("retain_graph"),
                                    bound.get("create_graph", False), bound.get("inputs"))
    return func(*args, **kwargs)


def _engine_backward(tensors: Any, grads: Any, retain_graph: Optional[bool], create_graph: bool,
                     inputs: Any) -> None:
    """What ``torch.autograd.backward`` does after its argument checks: autograd's engine, called directly."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    else:
        inputs = tuple(inputs)
        if not inputs:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                         inputs, allow_unreachable=True, accumulate_grad=True)


_MODE = threading.local()  # .mode: this thread's _IdleMode, once installed


def _stack() -> list[Any]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _restack(modes: list[Any]) -> None:
    """Replace this thread's torch-function mode stack with ``modes`` (bottom first)."""
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def watch(watcher: _Watcher) -> None:
    """Check ``watcher``'s parameters on every torch call of this thread from now on (outside its passes:
    ``watcher.check_idle`` decides); installs the bottom mode if this thread has none."""
    global _WATCHERS
    with _LOCK:
        _WATCHERS = (*_live_except(watcher), weakref.ref(watcher))
    mode = getattr(_MODE, "mode", None)
    stack = _stack()
    if mode is not None and any(m is mode for m in stack):
        return
    mode = _MODE.mode = _IdleMode()
    _restack([mode, *stack])


def unwatch(watcher: _Watcher) -> None:
    """Stop checking ``watcher``; with no watcher left, take this thread's mode off the stack."""
    global _WATCHERS
    with _LOCK:
        _WATCHERS = _live_except(watcher)
        left = len(_WATCHERS)
    mode = getattr(_MODE, "mode", None)
    if left or mode is None:
        return
    _restack([m for m in _stack() if m is not mode])
    _MODE.mode = None


def installed() -> bool:
    """Whether this thread's torch-function mode stack holds the watch (for tests)."""
    mode = getattr(_MODE, "mode", None)
    return mode is not None and any(m is mode for m in _stack())
