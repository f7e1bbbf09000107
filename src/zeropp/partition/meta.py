"""Partitioned construction: real weights for a model built on the meta device, one unit at a time.

Build the model under ``with torch.device("meta"):`` (no memory), hand it to ``zeropp.initialize`` with a
``param_init_fn``; each gather unit's parameters are then created on the host, initialized, cut into this
rank's shard and freed before the next unit's exist. Peak memory is the shards plus one unit (and the
modules sharing its parameters), never the whole model.

A meta tensor's storage cannot be swapped in place (``param.data = cpu_tensor`` is refused), so each meta
parameter is replaced by a new ``nn.Parameter`` in every module that holds it, which keeps tied weights
tied. Every rank runs the same initialization sequence from the same random state (the caller agrees on
rank 0's, ``values.agreed_rng``), so all ranks agree on every value, and each keeps only its chunk.

Note [nothing uninitialized]: a meta tensor has no values. Whatever the initialization does not write would
keep what the allocator returned: different on every rank, at times 1e16 or NaN, and trained on without a
word (a rotary embedding's ``inv_freq``, computed in ``__init__`` and lost on the meta device, is the usual
case). So every floating-point tensor starts as NaN, and a dispatch mode logs every tensor an op writes
while the initialization runs; after it:

* a parameter not fully written by ``param_init_fn`` goes to the model's own ``_init_weights`` (a Hugging
  Face model's per-module init) where there is one; if that does not write it either, :class:`UninitializedError`
  names it and says how to initialize it;
* a buffer not written (persistent or not) goes to ``_init_weights`` too, then to a real construction of its
  module: ``type(module)(...)`` on the host, with the arguments of its ``__init__`` read from the module's
  attributes (``LlamaRotaryEmbedding(config)``, ``Conv1D(nf, nx)``), which computes what a build without the
  meta device would have; the buffer is copied from it. Where that cannot be done (an argument the module
  does not keep, a module larger than a unit) the error names the buffer and the argument.

All of it runs before the first step, identically on every rank, so every rank raises the same error.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zeropp.partition.assign import UnitPlan

log = logging.getLogger("zeropp")


class UninitializedError(RuntimeError):
    """A parameter or buffer of a meta-built model that no initialization wrote (the message names it)."""


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()`` where the module has one; what it leaves is checked afterwards."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _WriteLog(TorchDispatchMode):
    """Records which watched tensors an op writes (in-place ops, ``out=`` arguments), by storage.

    Only integer and boolean tensors are watched (a float one tells by its NaN); a tensor is watched from its
    creation until it is checked, so no other tensor can hold its storage address meanwhile.
    """

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, int] = {}  # storage address -> id of the watched tensor
        self.written: set[int] = set()  # ids of watched tensors written

    def watch(self, t: torch.Tensor) -> None:
        if not (t.is_floating_point() or t.is_complex()) and t.numel():
            self.watched[_storage_key(t)] = id(t)

    def mark(self, t: torch.Tensor) -> None:
        self.written.add(id(t))

    def done(self, t: torch.Tensor) -> None:
        """Stop watching ``t`` (checked: its storage may be freed and its address reused from now on)."""
        if t.numel() and self.watched.get(_storage_key(t)) == id(t):
            del self.watched[_storage_key(t)]
        self.written.discard(id(t))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and t.numel():
                    hit = self.watched.get(_storage_key(t))
                    if hit is not None:
                        self.written.add(hit)
        return func(*args, **kwargs)


def _blank(like: torch.Tensor) -> torch.Tensor:
    """A host tensor of ``like``'s shape and dtype: NaN where it can hold one (Note [nothing uninitialized])."""
    if like.is_floating_point() or like.is_complex():
        return torch.full(like.shape, float("nan"), dtype=like.dtype)
    return torch.empty(like.shape, dtype=like.dtype)


class MetaMaterializer:
    """Replaces meta parameters (and buffers) with host tensors, a unit's holder modules at a time.

    ``init=False`` only allocates (the values come from elsewhere: rank 0, ``values.RankZeroValues``).
    ``rebuild_limit``: the most parameter elements a real construction of a module may allocate to recompute
    its buffers (the engine passes its largest unit, which is materialized whole anyway).
    """

    def __init__(self, root: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None, *,
                 init: bool = True, rebuild_limit: int = 0) -> None:
        self.init_fn = init_fn or default_init
        own = getattr(root, "_init_weights", None)
        # the model's own per-module init, for what param_init_fn leaves (unless it is param_init_fn)
        self.fallback = own if callable(own) and init_fn != own else None
        self.init = init
        self.rebuild_limit = rebuild_limit
        named = list(root.named_modules())
        self.modules = [m for _, m in named]
        self.module_names = {id(m): name for name, m in named}
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in self.modules:
            for attr, p in module._parameters.items():
                if p is not None:
                    self.holders.setdefault(id(p), []).append((module, attr))
        self.replaced: dict[int, nn.Parameter] = {}
        self.initialized: set[int] = set()
        self._fresh: dict[int, list[str]] = {}  # module id -> its buffers made here, to check after its init
        self._log = _WriteLog()
        self._fallback_used: list[str] = []

    @staticmethod
    def needed(root: nn.Module) -> bool:
        return any(p.is_meta for p in root.parameters()) or any(b.is_meta for b in root.buffers())

    def realize(self, plan: UnitPlan) -> UnitPlan:
        """Give every parameter of ``plan`` real, initialized values; return the plan with the new objects."""
        wanted = {id(self.replaced.get(id(p), p)) for _, p in plan.params}
        wanted |= {id(p) for _, p in plan.params}
        owners = {id(m): m for pid in wanted for m, _ in self.holders.get(pid, [])}
        for module in self.modules:  # definition order: the same on every rank
            if id(module) in owners:
                self._realize_module(module)
        params = [(name, self.replaced.get(id(p), p)) for name, p in plan.params]
        if self.init:
            made = {id(p) for p in self.replaced.values()}
            self._ensure_params_written([(n, p) for n, p in params if id(p) in made])  # not real ones it was handed
            for module in self.modules:
                if id(module) in owners:
                    self._ensure_buffers_written(module)
        return UnitPlan(plan.module_name, plan.module, params)

    def _realize_module(self, module: nn.Module) -> None:
        for attr, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                made = nn.Parameter(_blank(p) if self.init else torch.empty(p.shape, dtype=p.dtype),
                                    requires_grad=p.requires_grad)
                self._log.watch(made)
                self._replace(p, made)
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = _blank(b) if self.init else torch.empty(b.shape, dtype=b.dtype)
                self._log.watch(module._buffers[attr])
                self._fresh.setdefault(id(module), []).append(attr)
        if id(module) not in self.initialized:
            self.initialized.add(id(module))
            if self.init and (module._parameters or module._buffers):
                self._run_init(self.init_fn, module)

    def _replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        for module, attr in self.holders[id(old)]:
            module._parameters[attr] = new
        self.holders[id(new)] = self.holders.pop(id(old))
        self.replaced[id(old)] = new

    def _run_init(self, fn: Callable[[nn.Module], None], module: nn.Module) -> None:
        """``fn(module)`` with writes logged; a parameter the init assigned anew is copied into ours (the one
        every holder and the unit refer to), a buffer assigned anew is kept as it is."""
        params = dict(module._parameters)
        buffers = dict(module._buffers)
        with torch.no_grad(), self._log:
            fn(module)
        with torch.no_grad():
            for attr, ours in params.items():
                new = module._parameters.get(attr)
                if ours is None or new is ours:
                    continue
                if new is None or new.shape != ours.shape or new.is_meta:
                    raise UninitializedError(
                        f"the initialization of {self._name(module, attr)!r} replaced the parameter by "
                        f"{'None' if new is None else f'one of shape {tuple(new.shape)}'}; write into it instead "
                        f"(for example module.{attr}.copy_(...))")
                ours.copy_(new)
                self._log.mark(ours)
                module._parameters[attr] = ours
            for attr, ours in buffers.items():
                new = module._buffers.get(attr)
                if new is not None and new is not ours and not new.is_meta:
                    if ours is not None:
                        self._log.done(ours)
                    self._log.mark(new)

    def _written(self, t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return True
        if t.is_floating_point() or t.is_complex():
            return not bool(torch.isnan(t).any())
        return id(t) in self._log.written

    def _name(self, module: nn.Module, attr: str) -> str:
        prefix = self.module_names.get(id(module), "")
        return f"{prefix}.{attr}" if prefix else attr

    def _ensure_params_written(self, params: list[tuple[str, nn.Parameter]]) -> None:
        """Every parameter of a unit written: by ``param_init_fn``, else by the model's ``_init_weights``."""
        missing = [(n, p) for n, p in params if not self._written(p)]
        if missing and self.fallback is not None:
            for module in self._holder_modules(missing):
                self._run_init(self.fallback, module)
                self._fallback_used.append(type(module).__name__)
            missing = [(n, p) for n, p in params if not self._written(p)]
        if not missing:
            for _, p in params:
                self._log.done(p)
            return
        name, p = missing[0]
        module, attr = self.holders[id(p)][0]
        how = "param_init_fn" + (" or the model's _init_weights" if self.fallback is not None else "")
        part = "partly " if p.is_floating_point() and not bool(torch.isnan(p).all()) else ""
        more = f" (also unwritten: {[n for n, _ in missing[1:]]})" if len(missing) > 1 else ""
        raise UninitializedError(
            f"parameter {name!r} ({type(module).__name__}.{attr}, shape {tuple(p.shape)}) of a model built on the "
            f"meta device was {part}not written by {how}, so it would start training from uninitialized "
            f"memory{more}. Initialize it in param_init_fn (for example `if isinstance(module, "
            f"{type(module).__name__}): module.{attr}.normal_(0, 0.02)`, or give the module a reset_parameters()), "
            "or build the model under zeropp.zero.Init, which runs every module's __init__ for real")

    def _holder_modules(self, params: list[tuple[str, nn.Parameter]]) -> list[nn.Module]:
        ids = {id(m) for _, p in params for m, _ in self.holders[id(p)]}
        return [m for m in self.modules if id(m) in ids]

    def _ensure_buffers_written(self, module: nn.Module) -> None:
        """Every buffer made here written: by the init, else ``_init_weights``, else a real construction."""
        attrs = [a for a in self._fresh.pop(id(module), []) if module._buffers.get(a) is not None]
        missing = [a for a in attrs if not self._written(module._buffers[a])]
        if missing and self.fallback is not None:
            self._run_init(self.fallback, module)
            missing = [a for a in missing if not self._written(module._buffers[a])]
        for attr in attrs:
            self._log.done(module._buffers[attr])
        if not missing:
            return
        real = rebuild_module(module, self.rebuild_limit)
        for attr in missing:
            ours = module._buffers[attr]
            theirs = real._buffers.get(attr) if isinstance(real, nn.Module) else None
            if theirs is None or theirs.shape != ours.shape:
                why = real if isinstance(real, str) else (
                    f"constructed again, it has {'no such buffer' if theirs is None else f'shape {tuple(theirs.shape)}'}")
                raise UninitializedError(
                    f"buffer {self._name(module, attr)!r} ({type(module).__name__}.{attr}, shape {tuple(ours.shape)}) "
                    "of a model built on the meta device was not written by param_init_fn, and zeropp cannot "
                    f"recompute it from a real construction of its module: {why}. Compute it in param_init_fn "
                    f"(`if isinstance(module, {type(module).__name__}): module.{attr}.copy_(...)`), or build the "
                    "model under zeropp.zero.Init, which runs every module's __init__ for real")
            with torch.no_grad():
                ours.copy_(theirs)
            log.info("meta construction: buffer %r recomputed by constructing %s again",
                     self._name(module, attr), type(module).__name__)

    def finish(self) -> None:
        """Realize buffers of modules that hold no parameters, and check nothing is left on meta."""
        for module in self.modules:
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                self._realize_module(module)
                if self.init:
                    self._ensure_buffers_written(module)
        for module in self.modules:
            for attr, p in module._parameters.items():
                if p is not None and p.is_meta:
                    raise RuntimeError(f"parameter {attr!r} of {type(module).__name__} is still on the meta device")
        if self._fallback_used:
            log.warning("meta construction: param_init_fn left parameters of %s unwritten; the model's "
                        "_init_weights initialized them", sorted(set(self._fallback_used)))


def rebuild_module(module: nn.Module, limit: int) -> Union[nn.Module, str]:
    """``type(module)`` constructed for real on the host from the module's own attributes, or why it cannot be."""
    cls = type(module)
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return f"the signature of {cls.__name__}.__init__ cannot be read"
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    attrs = vars(module)
    for name, prm in list(sig.parameters.items())[1:]:
        if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            continue
        if name in attrs:
            (args.append(attrs[name]) if prm.kind is prm.POSITIONAL_ONLY else kwargs.__setitem__(name, attrs[name]))
        elif prm.default is prm.empty:
            return f"{cls.__name__}.__init__ takes {name!r}, which the module does not keep as an attribute"
    size = sum(p.numel() for p in module.parameters())
    if size > limit:
        return (f"constructing {cls.__name__} would allocate its {size:,} parameter elements at once, more than "
                f"the largest gather unit ({limit:,})")
    try:
        with torch.device("cpu"), torch.random.fork_rng(devices=[]):
            return cls(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure of user code means "cannot recompute"; reported
        return f"{cls.__name__}(...) raised {type(err).__name__}: {err}"
