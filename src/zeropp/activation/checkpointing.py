"""Activation checkpointing: ``checkpoint(fn, *args)``, with the settings of DeepSpeed's
``activation_checkpointing`` section (``zeropp.checkpointing`` is DeepSpeed's module over this one:
``zeropp/deepspeed/checkpointing.py``).

A checkpointed function keeps only its inputs through the forward pass and runs again during backward to
rebuild its activations. Under stage 3 the rerun needs its weights again: the engine gathers them like any
backward gather (from hpZ's secondary shards when hpZ is on, so no byte crosses nodes), and a weight the
rerun reads is served on demand like every read outside its module's forward (Note [external reads]).

The rerun uses torch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``), which preserves the RNG state (dropout draws the same mask twice) and works with
inputs that do not require gradients. ``torch.utils.checkpoint`` itself and Hugging Face's
``model.gradient_checkpointing_enable()`` work with every stage as well; this module exists so that a
DeepSpeed script's ``deepspeed.checkpointing.checkpoint`` runs unchanged, and so that DeepSpeed's settings
apply (to a Hugging Face model too, through :func:`gradient_checkpointing_enable`).

:func:`use` (DeepSpeed's ``checkpointing.configure``, or the config's ``activation_checkpointing`` section,
which ``zeropp.api.build`` applies when the config has one) sets DeepSpeed's keys; every one of them takes
effect:

* ``cpu_checkpointing`` (``checkpoint_in_cpu``): the inputs a checkpoint keeps for its rerun wait in host
  memory. They go down through a host link (``offload/link.py``; on CUDA a side stream into page-locked
  memory, asynchronous) when the forward saves them and come back when backward reruns the function. On a
  CPU-only run the host is the compute device and nothing is copied; :func:`set_link` injects a link (a
  test plays a separate device with ``ThreadedLink``).
* ``partition_activations``: DeepSpeed splits each checkpoint across the model-parallel group and keeps it
  whole when that group has one rank. zeropp has no model parallelism, so ``true`` does the same (a
  ``ConfigWarning`` says so once). ``"node"`` splits each checkpoint input across the data-parallel ranks of
  the node (Note [node-split checkpoints] in ``activation/split.py``): a rank then holds the node's mean of
  the checkpoint bytes instead of its own, which helps when the ranks' micro-batches differ in size.
* ``contiguous_memory_optimization`` with ``number_checkpoints``: the inputs are copied into slots of one
  buffer per input size, allocated once with ``number_checkpoints`` slots, so long-lived checkpoints do not
  interleave with short-lived activations in the allocator (ZeRO-R's defragmentation). More inputs alive at
  once than slots is an error naming ``number_checkpoints``.
* ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` before and after each checkpointed
  forward and rerun (CUDA inputs only; on the CPU there is nothing to wait for).
* ``profile``: each checkpointed forward and rerun is timed (synchronized on CUDA), logged on the
  ``zeropp`` logger and summed in :func:`timings`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from zeropp.activation.split import NodeSplit, SplitInput
from zeropp.comm.ops import Comm
from zeropp.offload.link import HOST, HostLink, Transfer, build_link
from zeropp.errors import NotBuiltError
from zeropp.zero.memory import count_on_host, outer_saved_tensor_hooks, register_buffers

__all__ = ["checkpoint", "use", "restore", "settings_from", "apply_config", "is_configured", "reset", "set_link",
           "timings", "settings", "gradient_checkpointing_enable", "attach", "Settings"]

log = logging.getLogger("zeropp")


@dataclass(frozen=True)
class Settings:
    """DeepSpeed's ``activation_checkpointing`` keys, as :func:`use` set them."""

    partition_activations: bool | str = False  # True: DeepSpeed's (whole, no model parallelism); "node": split
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_settings: Optional[Settings] = None  # None until configure() ran (DeepSpeed's is_configured())
_link: Optional[HostLink] = None  # set_link(); None: chosen per device
_device_links: dict[torch.device, HostLink] = {}
_slots: dict[tuple, "_SlotBuffer"] = {}  # contiguous_memory_optimization's buffers, by input size
_times: dict[str, list[float]] = {}  # profile: kind -> [count, total seconds]
_lock = threading.RLock()  # slots come back when autograd frees a saved input, maybe on its device thread
_warned: set[str] = set()  # the notes given so far (each once per process)
_deferred: Optional[str] = None  # a problem of the settings apply_config took, raised when a checkpoint runs
_split: Optional[NodeSplit] = None  # attach(): the node's ranks, for partition_activations "node"

PARTITION_NOTE = (
    "activation_checkpointing.partition_activations: DeepSpeed splits each activation checkpoint across the "
    "model-parallel group and keeps it whole when that group has one rank. zeropp has no model parallelism, "
    "so every rank keeps its checkpoints whole, as DeepSpeed does then. partition_activations: \"node\" splits "
    "them across the data-parallel ranks of a node instead; that does not lower memory per rank when the ranks' "
    "micro-batches are alike (each holds 1/D of D equally large checkpoints) and costs traffic inside the node "
    "(docs/config.md).")
CONTIGUOUS_NOTE = (
    "activation_checkpointing.contiguous_memory_optimization: no number_checkpoints is given, which sizes its "
    "buffer; checkpoints keep their inputs where they are until checkpointing.configure(num_checkpoints=...) is "
    "called (as in DeepSpeed, whose initialize never applies this section).")
SCOPE_NOTE = (
    "activation_checkpointing: these settings apply to zeropp.activation.checkpointing.checkpoint (deepspeed.checkpointing."
    "checkpoint) and to Hugging Face models enabled with zeropp.activation.checkpointing.gradient_checkpointing_enable(model); "
    "torch.utils.checkpoint and model.gradient_checkpointing_enable() (the Trainer's gradient_checkpointing) "
    "do not read them, as in DeepSpeed.")


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its arguments for backward and running it again there.

    Tensor keyword arguments are kept like positional ones (as DeepSpeed does). Where the kept inputs wait
    follows :func:`use` (host memory with ``cpu_checkpointing``, a preallocated buffer with
    ``contiguous_memory_optimization``).
    """
    s = _settings or Settings()
    if _deferred is not None and torch.is_grad_enabled():
        raise NotBuiltError(_deferred)
    if kwargs:
        function, args = _positional(function, args, kwargs)
    edges = _Edges(s, args)
    moves = s.cpu_checkpointing or s.contiguous_memory_optimization or s.partition_activations == "node"
    hooks = _InputHooks(s) if moves and torch.is_grad_enabled() else contextlib.nullcontext()
    with edges.around("forward"), hooks:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                           context_fn=edges.context_fn())


def use(s: Settings) -> None:
    """Put ``s`` in force (the settings of earlier calls are dropped). Raises :class:`NotBuiltError` for
    contiguous checkpointing without ``number_checkpoints``, for contiguous checkpointing together with
    ``cpu_checkpointing`` (the contiguous buffers stay on the device; so would these), and for
    ``partition_activations="node"`` together with either (or any other value than a boolean or ``"node"``)."""
    problem = _problem(s)
    if problem is not None:
        raise NotBuiltError(f"checkpointing.configure: {problem}")
    _install(s, None)


def apply_config(config: Any) -> None:
    """What ``zeropp.initialize`` does with a config that has an ``activation_checkpointing`` section: the same
    settings as ``configure(deepspeed_config=config)``, except for what ``configure`` refuses. Contiguous
    checkpointing without ``number_checkpoints`` (Megatron's configs leave the count to the script's own
    ``configure(..., num_checkpoints=...)`` call) is left off, with a ``ConfigWarning``, until a ``configure`` call
    gives the count: DeepSpeed's ``initialize`` never applies the section, so its checkpoints run without it too.
    Another combination ``configure`` refuses is raised by the first checkpoint that runs, not here."""
    s = settings_from(config)
    if s.contiguous_memory_optimization and s.number_checkpoints is None:
        s = dataclasses.replace(s, contiguous_memory_optimization=False)
        _warn_once("contiguous", CONTIGUOUS_NOTE)
    problem = _problem(s)
    _install(s, None if problem is None else f"activation_checkpointing: {problem}")
    if s.cpu_checkpointing or s.contiguous_memory_optimization or s.synchronize_checkpoint_boundary or s.profile:
        _warn_once("scope", SCOPE_NOTE)


def restore(s: Optional[Settings]) -> None:
    """Put ``s`` in force as it is, without :func:`use`'s checks (None: unconfigured, the defaults in force), for
    code that saves the settings and puts them back (DeepSpeed's module globals)."""
    if s is None:
        global _settings, _deferred
        with _lock:
            _settings, _deferred = None, None
        return
    _install(s, None)


def settings_from(config: Any) -> Settings:
    """The ``activation_checkpointing`` section of ``config`` (a path, dict or ``ZeroppConfig``; None: the
    defaults) as settings."""
    if config is None:
        return Settings()
    from zeropp.config.loader import load_config  # imported here to keep import light
    section = load_config(config).activation_checkpointing
    return Settings(section.partition_activations, section.cpu_checkpointing, section.contiguous_memory_optimization,
                    section.number_checkpoints, section.synchronize_checkpoint_boundary, section.profile)


def _problem(s: Settings) -> Optional[str]:
    if not isinstance(s.partition_activations, bool) and s.partition_activations != "node":
        return f"partition_activations must be true, false or \"node\", got {s.partition_activations!r}"
    if s.partition_activations == "node" and (s.cpu_checkpointing or s.contiguous_memory_optimization):
        return ("partition_activations \"node\" together with cpu_checkpointing or contiguous_memory_optimization "
                "is not supported: the split pieces stay in device memory; choose one")
    if s.contiguous_memory_optimization and s.number_checkpoints is None:
        return "contiguous_memory_optimization needs number_checkpoints (num_checkpoints), which sizes its buffer"
    if s.contiguous_memory_optimization and s.cpu_checkpointing:
        return ("contiguous_memory_optimization together with cpu_checkpointing is not supported: the contiguous "
                "buffer lives on the compute device, cpu_checkpointing keeps checkpoints on the host; choose one")
    return None


def _install(s: Settings, deferred: Optional[str]) -> None:
    if s.partition_activations is True:
        _warn_partition_once()
    global _settings, _deferred
    with _lock:
        _settings, _deferred = s, deferred
        _slots.clear()
        _times.clear()


def is_configured() -> bool:
    """True once :func:`use` ran (DeepSpeed's check before using the module)."""
    return _settings is not None


def settings() -> Settings:
    """The settings in force (the defaults before :func:`use`)."""
    return _settings or Settings()


def reset() -> None:
    """DeepSpeed's ``reset()``: drop the contiguous checkpoint buffers (between evaluation forwards that run no
    backward); the settings stay. A slot still holding a saved input keeps its buffer alive until autograd
    drops it."""
    with _lock:
        _slots.clear()


def attach(comm: Optional[Comm]) -> None:
    """The process groups ``partition_activations: "node"`` splits over (the node's ranks of ``comm``'s
    topology); ``zeropp.initialize`` attaches its engine's. None detaches."""
    global _split
    _split = NodeSplit(comm) if comm is not None else None


def set_link(link: Optional[HostLink]) -> None:
    """The host link ``cpu_checkpointing`` copies through; None (the default) picks one from each input's
    device: streams into page-locked memory on CUDA, none on the CPU (the host is the device). Tests inject
    ``ThreadedLink`` to play a separate device on the CPU."""
    global _link
    _link = link


def timings() -> dict[str, dict[str, float]]:
    """``profile``: ``{"forward"|"recompute": {"count", "total_s"}}`` since the last :func:`use`."""
    with _lock:
        return {kind: {"count": int(c), "total_s": t} for kind, (c, t) in _times.items()}


def gradient_checkpointing_enable(model: nn.Module, every_n_layers: int = 1) -> None:
    """Turn on a Hugging Face model's activation checkpointing through :func:`checkpoint`, so the settings of
    :func:`use` (``cpu_checkpointing``...) apply to it.

    transformers (5.x) has no public argument for the checkpoint function: ``activation_checkpointing_enable``
    always uses ``torch.utils.checkpoint``, and its ``offload=True`` is Hugging Face's own host offload
    (torch's ``save_on_cpu``). This calls the method that one calls, ``model._set_gradient_checkpointing(
    enable=True, gradient_checkpointing_func=...)`` (transformers 4.35 and later); a model without it raises
    :class:`~zeropp.errors.NotBuiltError`.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    set_func = getattr(model, "_set_gradient_checkpointing", None)
    params = inspect.signature(set_func).parameters if set_func is not None else {}
    if "gradient_checkpointing_func" not in params:
        raise NotBuiltError(f"{type(model).__name__}: this transformers version offers no way to set the "
                                "checkpoint function (_set_gradient_checkpointing(gradient_checkpointing_func=)); "
                                "use model.gradient_checkpointing_enable() (torch's checkpoint) instead")
    extra: dict[str, Any] = {}
    if "every_n_layers" in params:
        extra["every_n_layers"] = every_n_layers
    elif every_n_layers != 1:
        raise NotBuiltError("gradient_checkpointing_enable(every_n_layers=...): this transformers version "
                                "checkpoints every layer")
    set_func(enable=True, gradient_checkpointing_func=checkpoint, **extra)


# ---- where saved inputs wait -------------------------------------------------------------------------------
class _InputHooks(torch.autograd.graph.saved_tensors_hooks):
    """Around one checkpoint call: the inputs it saves for the rerun (autograd saves nothing else here, the
    function's own tensors go to torch's checkpoint hooks) wait on the host, in a slot or split across the
    node; anything else goes on to the hooks that were active before (Note [activation meter] in
    ``zero/memory.py``)."""

    def __init__(self, s: Settings) -> None:
        outer = outer_saved_tensor_hooks()
        if outer is None:
            raise NotBuiltError("activation_checkpointing: cpu_checkpointing and contiguous_memory_optimization "
                                    "need torch's saved-tensor hook stack (torch._C._autograd."
                                    "_top_saved_tensors_default_hooks), which this torch does not expose")
        outer_pack, outer_unpack = outer
        # inside another checkpoint's forward or rerun, what is saved is that checkpoint's business (torch's
        # hooks keep nothing there, its rerun rebuilds it): nothing to move
        nested = getattr(outer_pack, "__qualname__", "").startswith(("_checkpoint_hook.", "_recomputation_hook."))

        split = _node_split() if s.partition_activations == "node" and not nested else None

        def pack(t: torch.Tensor) -> Any:
            if not nested and _is_activation(t):
                if split is not None:
                    kept = split.split(t, _dense(t))
                    return _Kept(outer_pack(kept.pieces), split=kept)
                if s.cpu_checkpointing:
                    on_host = _to_host(t)
                    if on_host is not None:
                        return on_host
                elif s.contiguous_memory_optimization:
                    slot = _slot_for(t, s.number_checkpoints or 1)
                    return _Kept(outer_pack(slot.tensor), slot)
            return _Kept(outer_pack(t))

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _OnHost):
                return saved.restore()
            if saved.split is not None:
                assert split is not None
                saved.split.pieces = outer_unpack(saved.inner)
                return split.join(saved.split)
            return outer_unpack(saved.inner)

        super().__init__(pack, unpack)


@dataclass
class _Kept:
    inner: Any  # what the outer hooks packed
    slot: Optional["_Slot"] = None  # contiguous: held until autograd drops this
    split: Optional[SplitInput] = None  # partition_activations "node": what to rebuild the input from


def _node_split() -> Optional[NodeSplit]:
    """The node's ranks to split over (None when a node has one rank: nothing to split)."""
    if _split is None:
        raise NotBuiltError("activation_checkpointing.partition_activations \"node\" needs the ranks of the "
                                "node: build the engine with zeropp.initialize before the first checkpoint")
    return _split if _split.size > 1 else None


@dataclass
class _OnHost:
    """A saved input copied to the host: brought back to ``device`` with its strides for the rerun."""

    link: HostLink
    transfer: Transfer
    device: torch.device
    stride: tuple[int, ...]
    dense: bool
    token: Any  # counted as host bytes by a watching meter while held

    def restore(self) -> torch.Tensor:
        back = self.link.fetch(self.transfer.wait(), self.device).wait()
        if self.dense and back.stride() != self.stride:  # the rerun sees the layout the forward saw
            same = torch.empty_strided(back.shape, self.stride, dtype=back.dtype, device=back.device)
            back = same.copy_(back)
        return back


def _is_activation(t: torch.Tensor) -> bool:
    """A floating tensor that is not a weight (DeepSpeed moves floating tensors only)."""
    return (t.is_floating_point() and t.numel() > 0 and not isinstance(t, nn.Parameter)
            and not isinstance(t._base, nn.Parameter))


def _to_host(t: torch.Tensor) -> Optional[_OnHost]:
    link = _link if _link is not None else _device_link(t.device)
    if link is None:
        return None  # the host is the compute device: nothing to copy
    src = t.detach()
    transfer = link.download(src) if link.distinct else Transfer(src.to(HOST))
    return _OnHost(link, transfer, t.device, t.stride(), _dense(t), count_on_host(transfer.destination))


def _device_link(device: torch.device) -> Optional[HostLink]:
    if device.type == "cpu":
        return None
    if device not in _device_links:
        # CUDA: streams into page-locked memory; another accelerator: HostLink, copied synchronously above
        _device_links[device] = build_link(device, offloads=True, pin_memory=True)
    return _device_links[device]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlap (then its strides can be rebuilt)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# ---- contiguous_memory_optimization ------------------------------------------------------------------------
class _SlotBuffer:
    """``count`` slots of one preallocated ``[count, numel]`` buffer for inputs of one size and dtype."""

    def __init__(self, count: int, like: torch.Tensor) -> None:
        self.data = torch.empty(count, like.numel(), dtype=like.dtype, device=like.device)
        self.free = list(range(count - 1, -1, -1))


class _Slot:
    """One taken slot: ``tensor`` holds the input; the slot is free again once autograd drops this."""

    def __init__(self, buffer: _SlotBuffer, index: int, t: torch.Tensor) -> None:
        self.buffer, self.index = buffer, index
        self.tensor = buffer.data[index].view(t.shape).copy_(t.detach())

    def __del__(self) -> None:
        with _lock:
            self.buffer.free.append(self.index)


def _slot_for(t: torch.Tensor, count: int) -> _Slot:
    key = (t.numel(), t.dtype, t.device)
    with _lock:
        buffer = _slots.get(key)
        if buffer is None:
            for other in [k for k, b in _slots.items() if len(b.free) == count]:
                del _slots[other]  # inputs changed size (another sequence length): drop unused buffers
            buffer = _slots[key] = _SlotBuffer(count, t)
        if not buffer.free:
            raise NotBuiltError(
                f"activation_checkpointing.contiguous_memory_optimization: more than number_checkpoints={count} "
                f"checkpoint inputs of shape {tuple(t.shape)} are held at once; raise number_checkpoints to the "
                "number of checkpoints a forward (or the forwards before one backward) makes")
        index = buffer.free.pop()
    return _Slot(buffer, index, t)


def buffer_bytes() -> dict[str, int]:
    """Bytes of the contiguous checkpoint buffers allocated now (0 without contiguous_memory_optimization)."""
    with _lock:
        return {f"contiguous_checkpoints[{n}x{str(d).replace('torch.', '')}]": b.data.untyped_storage().nbytes()
                for (n, d, _), b in _slots.items()}


register_buffers("activation_checkpoints", buffer_bytes)  # listed by engine.memory_report()


# ---- synchronize_checkpoint_boundary and profile -----------------------------------------------------------
class _Edges:
    """What happens at the edges of a checkpointed forward and of its rerun: device synchronization and timing."""

    def __init__(self, s: Settings, args: tuple) -> None:
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        self.sync = cuda and (s.synchronize_checkpoint_boundary or s.profile)  # CUDA timings need it too
        self.profile = s.profile

    def context_fn(self) -> Callable[[], tuple[Any, Any]]:
        if not (self.sync or self.profile):
            return torch_checkpoint.noop_context_fn
        return lambda: (contextlib.nullcontext(), self.around("recompute"))

    @contextlib.contextmanager
    def around(self, kind: str) -> Iterator[None]:
        if not (self.sync or self.profile):
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            if self.profile:
                _record(kind, time.perf_counter() - start)


def _record(kind: str, seconds: float) -> None:
    with _lock:
        entry = _times.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        n = entry[0]
    log.info("activation checkpoint %s #%d: %.3f ms", kind, n, seconds * 1e3)


# ---- small helpers -----------------------------------------------------------------------------------------
def _positional(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[Callable, tuple]:
    """Keyword arguments passed positionally, so their tensors are kept and moved like the others."""
    names, n = tuple(kwargs), len(args)

    def call(*all_args: Any) -> Any:
        return function(*all_args[:n], **dict(zip(names, all_args[n:])))

    return call, args + tuple(kwargs.values())


def _warn_partition_once() -> None:
    _warn_once("partition", PARTITION_NOTE)


def _warn_once(kind: str, note: str) -> None:
    if kind not in _warned:
        from zeropp.config.loader import ConfigWarning
        warnings.warn(note, ConfigWarning, stacklevel=4)
        _warned.add(kind)
