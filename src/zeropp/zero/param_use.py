"""Stage 3: serve reads of a parameter outside its unit's forward, and learn how long to keep it gathered.

Note [external reads]: a unit is gathered by its module's forward pre-hook and released by the post-hook.
Eager PyTorch models also read a module's weight elsewhere: a parent ties its output projection to a
child embedding (``h @ self.emb.weight.t()``), a sibling reads another module's parameter, a custom
autograd function saves a weight that only its backward reads, a submodule of a block runs outside the
block's forward. A released parameter has no storage, so such a read would crash torch, or read freed
memory. While the engine runs the model's forward and backward, :class:`ParamUse` watches for them:

* a ``TorchFunctionMode`` sees every torch call whose arguments include a managed parameter; a read of a
  released one gathers its unit there and then (for the current pass). A call that only reads metadata
  (shape, dtype, ``.grad``) gathers nothing. An in-place write is refused (:class:`ParameterAccessError`):
  the gathered copy is dropped at release, so the write would be silently lost.
* ``saved_tensors_hooks`` tag every saved tensor that shares a parameter's storage with its unit; unpacking
  it in backward gathers the unit if it was released (the weight saved by a parent's matmul or a custom
  function, a frozen module's weight needed for its input gradient).
* Forward: a unit read outside its module's forward is kept gathered until the forward of the innermost
  running module that contains it ends (its *span*), and the span is remembered, so from the next forward
  on the unit is released there instead of after its own forward: one gather per pass, as the ledger's
  formulas count. A unit gathered twice in one forward (a module called twice) learns a span the same way.
  The running forwards and the spans are ``Spans`` (``zero/spans.py``); when the weights go is decided by
  ``Releases`` (Note [one owner for release] in ``zero/release.py``).
* Backward: a trainable unit is released once all its gradients are in, a frozen one once the gradient of its
  module's inputs is computed (its backward is over).
* The engine's own work inside a pass (its module hooks, gradient hooks, gathers, releases, the saved-tensor
  hooks here) runs with torch-function handling off (:func:`unwatched`): only the model's calls are watched.

Note [direct calls]: the model, or any module of it, may also be called without the engine (``generate()``
runs a sequence-to-sequence model's encoder on its own, research code calls ``model.lm_head(h)``, an
evaluation loop calls a tower of the model). The first module entered outside the engine's passes opens
the same watch until its forward ends. A call on the model itself is a forward like the engine's and
learns spans as one; a call on a part of it holds every unit it reads outside their own forwards until
that part's forward ends and learns nothing, since the part's own view (its encoder alone, say) would
teach the engine's full forwards a span that keeps a unit gathered for longer than they need it.

Note [partitioned state dicts]: outside the passes a released parameter keeps its shape but has no storage.
``model.state_dict()`` would hand out tensors that ``torch.save`` writes as zero bytes (a file that fails
only when loaded), reading their values crashes the process, and ``load_state_dict`` would write into
nothing. State-dict hooks on every module that holds parameters turn the first two of these into a
:class:`ParameterAccessError` that names the parameters and the calls that do work; ``keep_vars=True``
(the parameters themselves, for their names and shapes) is allowed. Any other read outside the passes
(``w.sum()``, an EMA, ``copy.deepcopy``) is refused by name too: Note [reads between passes] in
``idle_watch.py``.

``register_external_parameter(module, param)`` declares a read in advance (DeepSpeed's API): the unit is
gathered for ``module``'s forward, even on the first step and on paths no earlier step took.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zeropp.partition.access import (METADATA, STORAGE_INFO, ParameterAccessError, call_args, call_name, is_inplace,
                                     is_noop)
from zeropp.partition.unit import ParamSlot, Unit, UnitState
from zeropp.zero import idle_watch
from zeropp.zero.gathers import Gathers, current_pass
from zeropp.zero.memory import freed_storage_key, storage_key
from zeropp.zero.release import Releases
from zeropp.zero.spans import Spans
from zeropp.zero.state import EngineState
from zeropp.zero.watching import unwatched

# module -> parameters it reads although another module owns them (register_external_parameter)
_EXTERNAL: "weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]]" = weakref.WeakKeyDictionary()

def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``param``, which another module owns (DeepSpeed's API).

    Stage 3 then gathers ``param``'s unit before ``module``'s forward and keeps it until that forward ends.
    Reads the engine sees are served without this; declaring them saves the first step's extra gather and
    covers reads on paths that no earlier step took. Harmless at stages 0-2 and on unmanaged modules.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"register_external_parameter: param must be a parameter, got {type(param).__name__}")
    held = _EXTERNAL.setdefault(module, [])
    if not any(p is param for p in held):
        held.append(param)


def unregister_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    held = _EXTERNAL.get(module, [])
    held[:] = [p for p in held if p is not param]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters :func:`register_external_parameter` declared for ``module``."""
    return list(_EXTERNAL.get(module, ()))


class _Saved:
    """A saved tensor that shares a parameter's storage, with the unit to gather before it is read."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: Unit, tensor: torch.Tensor) -> None:
        self.unit, self.tensor = unit, tensor


class _Mode(TorchFunctionMode):
    def __init__(self, use: "ParamUse") -> None:
        super().__init__()
        self.use = use

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a compiled region's reads are served by learned spans
            return func(*args, **kwargs)
        self.use.check_call(func, args, kwargs)
        return idle_watch.run_watched(self, func, types, args, kwargs)  # Note [watches stay on]


class ParamUse:
    """Finds and serves stage-3 parameter reads outside their unit's forward (Note [external reads]): a read of a
    released unit gathers it through ``gathers`` for the pass in progress; the module entries and exits it sees go
    to ``spans``, and the end of a hold to ``releases``."""

    def __init__(self, state: EngineState, root: nn.Module, gathers: Gathers, releases: Releases,
                 spans: Spans) -> None:
        # the parameters first: `copy.deepcopy(model)` copies this part through the hooks it put on the model, in
        # the order of its attributes, and must come to a released parameter (refused by name: Note [reads between
        # passes]) before anything that cannot be copied (the state's process groups)
        units = state.units
        self._slot: dict[int, tuple[Unit, ParamSlot]] = {id(s.param): (u, s) for u in units for s in u.slots}
        self._units = units
        self.state, self.gathers, self.releases, self.spans = state, gathers, releases, spans
        self._storage: dict[int, Unit] = {}
        self.storages_moved()
        self._names: dict[int, str] = {}
        self._trains_inside: dict[Unit, bool] = {}  # a frozen unit's module holds trainable parameters
        self._direct: Optional[contextlib.ExitStack] = None  # the watch of a forward not called through the engine
        self.hooks: list[Any] = []  # removed by the engine's destroy()
        self._root = root
        self._exits: dict[int, Any] = {}  # each module's exit hook, called even when its forward raises
        self._plain_exits: set[int] = set()  # ... but those in compiled blocks (Note [exit hooks in compiled ...])
        for name, mod in root.named_modules():
            self._names[id(mod)] = name
            self._exits[id(mod)] = mod.register_forward_hook(self._exit, always_call=True)
            self.hooks += [mod.register_forward_pre_hook(self._enter, prepend=True), self._exits[id(mod)]]
            if any(True for _ in mod.parameters(recurse=False)):
                self.hooks += [mod.register_state_dict_pre_hook(self._state_dict_read),
                               mod.register_load_state_dict_pre_hook(self._state_dict_write)]
        idle_watch.watch(self)  # Note [reads between passes]

    def remove_hooks(self) -> None:
        """Take this part's hooks off the model (the engine gives the model back: Note [leaving the model whole])."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def storages_moved(self) -> None:
        """Index the units by their parameters' storages again (a storage was handed over to its aliases)."""
        with torch._C.DisableTorchFunction():
            self._storage = {s.full.untyped_storage()._cdata: u for u in self._units for s in u.slots}

    def unit_of(self, t: torch.Tensor) -> Optional[Unit]:
        """The unit whose weights ``t`` shares storage with (a parameter, or what autograd saved of one and
        handed back as a plain tensor), else None."""
        return self._storage.get(storage_key(t))

    # ---- the model's forward and backward run inside this -----------------------------------------------
    def _gather(self, unit: Unit) -> None:
        self.gathers.gather(unit, current_pass(self.state))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Serve parameter reads of the forward or backward run inside this context."""
        self.spans.reset()  # the engine released every unit at the end of the last pass
        with _Mode(self), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """A pass of compiled code (Note [compiled regions] in ``compiled.py``; the engine sets the state's
        ``quiet``): no mode and no saved-tensor hooks; units with a learned span are held until the pass ends
        instead of until their span's end."""
        self.spans.reset()
        self._plain_exits_in_compiled_regions()
        yield

    def _plain_exits_in_compiled_regions(self) -> None:
        """Note [exit hooks in compiled regions]: a forward hook called even when the forward raises is looked
        up by its id, and Dynamo guards on that id; every block's hooks have other ids, so a block compiled in
        place (``block.compile()``, one code object for all blocks) recompiled for each block, and past Dynamo's
        limit of 8 the rest ran eagerly (1B Llama on an H200: 8 graphs, FSDP2 1). Inside compiled blocks the
        exit hook is a plain one: a module inside that raises leaves its entry, and the next exit of a module
        around it unwinds the stack to its own entry (``_exit``); the model's root keeps the hook that is
        always called."""
        for mod in self._root.modules():
            if getattr(mod, "_compiled_call_impl", None) is None or mod is self._root:
                continue
            for inner in mod.modules():
                hook = self._exits.get(id(inner))
                if hook is None or id(inner) in self._plain_exits:
                    continue
                hook.remove()
                self.hooks.remove(hook)
                self._exits[id(inner)] = inner.register_forward_hook(self._exit)
                self._plain_exits.add(id(inner))
                self.hooks.append(self._exits[id(inner)])

    @unwatched
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            unit = self._storage.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            return t
        return t if unit is None else _Saved(unit, t)

    @unwatched
    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Saved):
            if saved.unit.state is UnitState.SHARDED:
                self._gather(saved.unit)
            return saved.tensor
        return saved

    # ---- state dicts (Note [partitioned state dicts]) -------------------------------------------------------
    def _released(self, module: nn.Module, prefix: str, keys: Any = None) -> dict[str, str]:
        """The keys of ``module``'s released parameters (among ``keys`` if given), with their names in the
        model."""
        out = {}
        for pname, p in module.named_parameters(recurse=False):
            hit = self._slot.get(id(p))
            if hit is not None and hit[0].state is UnitState.SHARDED and (keys is None or prefix + pname in keys):
                out[prefix + pname] = hit[1].name
        return out

    def _state_dict_read(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # a pre-hook: refused before state_dict detaches anything (keep_vars=True hands out the parameters)
        names = [] if keep_vars else list(self._released(module, prefix).values())
        if names:
            raise ParameterAccessError(
                f"state_dict() of a stage-3 model read {names} while they are partitioned (released between "
                "forwards: no values on this rank), and would have saved empty tensors. Use "
                "engine.consolidated_state_dict() (on every rank) or engine.save_16bit_model(dir) for the full "
                "weights, engine.save_checkpoint(dir) to resume, or zeropp.zero.GatheredParameters(params)")

    def _state_dict_write(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        names = list(self._released(module, prefix, state_dict).values())
        if names:
            raise ParameterAccessError(
                f"load_state_dict() into a stage-3 model would write {names} while they are partitioned "
                "(released between forwards), and the values would be lost. Load weights before "
                "zeropp.initialize, resume with engine.load_checkpoint(dir), or change them inside "
                "zeropp.zero.GatheredParameters(params, modifier_rank=0)")

    # ---- module stack ------------------------------------------------------------------------------------
    def _enter(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # traced as nothing: compiled code keeps its units' spans by quiet()
            return
        name = self._names.get(id(module))
        if name is None:
            return
        if not self.state.in_pass:  # the model or a part of it called directly, not through the engine: watch it
            self.state.direct = True
            self._direct = contextlib.ExitStack()
            self._direct.enter_context(self.watching())
        self.spans.enter(name)
        for p in _EXTERNAL.get(module, ()):
            hit = self._slot.get(id(p))
            if hit is not None and hit[0].state is UnitState.SHARDED:
                self._gather(hit[0])
                self.spans.hold(name, hit[0])

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        name = self._names.get(id(module))
        if name is None or not self.spans.running(name):
            return
        for unit in self.spans.exit(name):
            self.releases.span_end(unit)
        if self._direct is not None and self.spans.empty:  # the directly called module's forward is over
            direct, self._direct = self._direct, None
            direct.close()
            self.state.direct = False

    def backward_reads(self, module: nn.Module, unit: Unit, args: Any) -> bool:
        """Whether the backward of ``module`` can read frozen ``unit``'s weights (Note [frozen units in backward]
        in ``partition/unit.py``): for an input's gradient, or for a trainable parameter of the module's (an
        adapter) whose gradient flows through them. A frozen embedding called on token ids needs neither."""
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(args)[0]):
            return True
        if unit not in self._trains_inside:
            self._trains_inside[unit] = any(p.requires_grad for p in module.parameters())
        return self._trains_inside[unit]

    # ---- between the passes (Note [reads between passes] in idle_watch.py) --------------------------------
    def check_idle(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Outside the passes: refuse a call that would read a released parameter's elements."""
        if self.state.in_pass:
            return
        for a, _ in call_args(args, kwargs):
            self._check_idle_arg(func, a, args, kwargs)

    def _check_idle_arg(self, func: Any, a: Any, args: tuple, kwargs: dict) -> None:
        hit = self._slot.get(id(a))
        if hit is None:
            unit = self._released_alias(a)
            if unit is not None and call_name(func) not in METADATA | STORAGE_INFO:  # Note [released storage]
                raise ParameterAccessError(
                    f"a tensor sharing the storage of {unit.segment_names()} (module {unit.module_name or '<root>'!r}) "
                    f"was read by {call_name(func)!r} after those weights were released (stage 3 partitions them "
                    "between forwards): it was taken from the parameters while they were gathered (detach(), "
                    "state_dict(), a view) and has no values now. Clone it while the weights are gathered, or read "
                    "inside zeropp.zero.GatheredParameters(params) (whose state_dict() values stay valid after it)")
            return
        if hit[0].state is not UnitState.SHARDED:
            return
        name = call_name(func)
        if name in METADATA or name in STORAGE_INFO or is_noop(name, args, kwargs):  # engine.module.cpu() on CPU
            return
        unit, slot = hit
        raise ParameterAccessError(
            f"parameter {slot.name!r} (module {unit.module_name or '<root>'!r}) of a stage-3 model was read by "
            f"{name!r} outside the engine's forward and backward, where it is partitioned: this rank holds "
            "only its shard, and the read would crash the process. Read weights inside a module's forward run "
            "by the engine (a weight penalty in a wrapper module's forward is gathered and differentiated), or "
            "within zeropp.zero.GatheredParameters(params) entered on every rank; for the full weights use "
            "engine.consolidated_state_dict() (on every rank) or engine.save_16bit_model(dir)")

    # ---- the torch-function check ------------------------------------------------------------------------
    def check_call(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Gather the released units whose parameters ``func`` reads; refuse in-place writes to them."""
        for a, first in call_args(args, kwargs):
            self._check_arg(func, a, first)
        out = kwargs.get("out")
        if out is not None and id(out) in self._slot:
            self._refuse(func, out)

    def _released_alias(self, a: Any) -> Optional[Unit]:
        """The released unit whose storage ``a`` views, for a tensor that is not a managed parameter itself (a
        ``detach()``, a ``state_dict()`` value, a view taken while the unit was gathered); else None. A
        released storage has no data (pointer 0), which is the cheap test that comes first."""
        if not isinstance(a, torch.Tensor):
            return None
        unit = self._storage.get(freed_storage_key(a))
        return unit if unit is not None and unit.state is UnitState.SHARDED else None

    def _check_arg(self, func: Any, a: Any, first: bool) -> None:
        hit = self._slot.get(id(a))
        if hit is None:
            unit = self._released_alias(a)  # Note [released storage]; a storage's identity or size is no read
            if unit is not None and call_name(func) not in METADATA | STORAGE_INFO:
                self._gather(unit)
            return
        name = call_name(func)
        if name in METADATA:
            return
        if first and is_inplace(name):
            self._refuse(func, a)
        unit = hit[0]
        if unit.state is UnitState.SHARDED:
            reader = self.spans.reader
            self._gather(unit)
            if not self.state.backward_open:
                self.spans.learn(unit, reader, self.state.direct)

    def _refuse(self, func: Any, param: Any) -> None:
        unit, slot = self._slot[id(param)]
        reader = self.spans.reader if not self.spans.empty else "<root>"
        raise ParameterAccessError(
            f"parameter {slot.name!r} (owned by module {unit.module_name or '<root>'!r}) was modified in place "
            f"by {call_name(func)!r} in the forward or backward of module {reader or '<root>'!r}; under ZeRO "
            "stage 3 the gathered copy is dropped when the module's weights are released, so the change would "
            "be lost. Change weights outside the forward, inside zeropp.zero.GatheredParameters([param], "
            "modifier_rank=0), or use stage 0-2")
