"""ZeRO-R's residual memory on one rank, measured: the activations saved for backward (:class:`ActivationMeter`),
the storages that are weights, and the buffers of components outside the engine. ``engine.memory_report()``
(``zero/reports.py``) puts them beside the engine's buffers and model states.

Note [activation meter]: activations are measured, not estimated. While the engine runs a forward,
:class:`ActivationMeter` sits in autograd's ``saved_tensors_hooks`` and counts every tensor autograd saves
for backward, once per storage (views and tensors saved twice count once), from the moment it is saved
until autograd drops it (after backward used it, or with the graph). Weights and module buffers are not
activations and are left out (their storages are named by the engine). Hooks do not nest in torch (only the
innermost pair runs), so the meter chains to the pair that was active when it was pushed (stage 3's
weight tracking, a user's own hooks) and anything pushed inside it chains to the meter in turn
(:func:`outer_saved_tensor_hooks`). A saved tensor held somewhere other than the compute device (a
checkpoint input that ``cpu_checkpointing`` copied to the host) is reported through :func:`count_on_host`.

What the meter does not see: tensors that live only inside backward (a checkpointed block's recomputed
activations, the inputs brought back for that recomputation, gradients): about one block's activations at
a time. On CUDA, ``torch.cuda.max_memory_allocated`` covers everything and is reported beside it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch


DEVICE, HOST = "device", "host"
_local = threading.local()  # .meters: the meters watching on this thread (innermost last)


def _identity(x: Any) -> Any:
    return x


Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def outer_saved_tensor_hooks() -> Optional[Hooks]:
    """The ``saved_tensors_hooks`` pair active now (identity when none), for a new pair to chain to.

    torch runs only the innermost pair, so a pair that wants to add to what is already there (not replace
    it) calls this one itself. torch exposes the stack only privately (torch 2.13, as its own AOT autograd
    reads it); None where it does not, and then no pair may be pushed: it would replace the one in force.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    return top(False) or (_identity, _identity)


def storage_key(t: torch.Tensor) -> Optional[int]:
    """The identity of ``t``'s storage (kept by a storage resized to 0), or None for storage-less tensors.

    Torch-function modes do not see it: stage 3's ``ParamUse`` would take it for a read of the weights (and
    gather a released unit). The storage's size is read the same way (:func:`storage_bytes`)."""
    try:
        with torch._C.DisableTorchFunction():
            return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def freed_storage_key(t: torch.Tensor) -> Optional[int]:
    """:func:`storage_key` of a tensor that has elements but no data: a view of a freed storage (a released
    unit's, a parameter partitioned at construction). None for any other tensor; the data pointer, the cheap
    test, comes first."""
    try:
        with torch._C.DisableTorchFunction():
            if t.data_ptr() != 0 or t.is_meta or t.numel() == 0:
                return None
            return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
        return None


_NO_MODES = torch._C.DisableTorchFunction


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s whole storage (what it keeps alive), unseen by torch-function modes."""
    with torch._C.DisableTorchFunction():
        return t.untyped_storage().nbytes()


class _Token:
    """One saved tensor as the meters see it; counted until autograd drops what holds the token."""

    __slots__ = ("meters", "key", "__weakref__")

    def __init__(self, meters: list["ActivationMeter"], key: int, nbytes: int, role: str) -> None:
        self.meters, self.key = meters, key
        for m in meters:
            m._hold(key, nbytes, role)

    def __del__(self) -> None:
        for m in self.meters:
            m._drop(self.key)


def _active() -> list["ActivationMeter"]:
    return getattr(_local, "meters", [])


def count_on_host(t: torch.Tensor) -> Optional[_Token]:
    """Count ``t`` (a saved tensor kept in host memory) in every meter watching on this thread, as host bytes,
    until the returned token is dropped; None when no meter watches."""
    meters, key = list(_active()), storage_key(t)
    if not meters or key is None:
        return None
    return _Token(meters, key, storage_bytes(t), HOST)


class ActivationMeter:
    """Bytes of the tensors saved for backward, live at once, by where they are held (Note [activation meter]).

    The storages of ``model``'s parameters and buffers are not activations: read once here, and again by
    :meth:`weights_moved`. ``last_step`` holds the peaks of the last closed step.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._excluded = weight_storages(model)
        self._live: dict[int, list[Any]] = {}  # storage key -> [holders, bytes, role]
        # autograd may free saved tensors on its device threads (CUDA); reentrant because a garbage
        # collection inside the locked region can run _Token.__del__, which takes the lock again
        self._lock = threading.RLock()
        self.now = {DEVICE: 0, HOST: 0}
        self.peak = dict(self.now)
        self.last_step: Optional[dict[str, int]] = None
        self.measured = outer_saved_tensor_hooks() is not None  # False: this torch hides the hook stack

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count what autograd saves inside the block (chained to the hooks active at entry)."""
        outer = outer_saved_tensor_hooks()
        if outer is None:  # counting would replace the hooks in force (stage 3's): count nothing instead
            yield
            return
        excluded = self._excluded
        outer_pack, outer_unpack = outer

        meters = [self]

        def pack(t: torch.Tensor) -> tuple[Any, Optional[_Token]]:
            # every saved tensor passes here: one storage read with the modes off, the token only for activations
            token = None
            with _NO_MODES():
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
                    storage = None
                if storage is not None and storage._cdata not in excluded and not t.is_meta:
                    token = _Token(meters, storage._cdata, storage.nbytes(), DEVICE)
            return outer_pack(t), token

        def unpack(held: tuple[Any, Optional[_Token]]) -> torch.Tensor:
            return outer_unpack(held[0])

        stack = _active()
        _local.meters = stack + [self]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            _local.meters = stack

    def weights_moved(self) -> None:
        """The model's weights moved to new storages (a stage-3 unit's buffers left to aliases): read them again.
        Outside a stage-3 pass only (:func:`weight_storages`)."""
        self._excluded = weight_storages(self._model)

    def _hold(self, key: int, nbytes: int, role: str) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                entry[0] += 1
                return
            self._live[key] = [1, nbytes, role]
            self.now[role] += nbytes
            self.peak[role] = max(self.peak[role], self.now[role])

    def _drop(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self.now[entry[2]] -= entry[1]

    def close_step(self) -> None:
        """Keep this step's peaks as ``last_step``; the next step's peaks start from what is held now."""
        self.last_step = dict(self.peak)
        self.peak = dict(self.now)

    def report(self) -> dict[str, int]:
        """Peaks of the last closed step (of the steps so far when none closed yet) and the bytes held now."""
        peak = self.last_step if self.last_step is not None else self.peak
        return {"saved_peak_device": peak[DEVICE], "saved_peak_host": peak[HOST],
                "saved_now_device": self.now[DEVICE], "saved_now_host": self.now[HOST], "measured": self.measured}


def weight_storages(module: torch.nn.Module) -> set[int]:
    """Storage keys of ``module``'s parameters and buffers: saved tensors that are not activations. Call it
    outside a stage-3 pass (a parameter's storage is its unit's full buffer, the same object while it is
    resized; reading it inside the pass would count as a read of the weights)."""
    keys = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
    keys.discard(None)
    return keys  # type: ignore[return-value]


_BUFFER_SOURCES: dict[str, Callable[[], dict[str, int]]] = {}


def register_buffers(name: str, source: Callable[[], dict[str, int]]) -> None:
    """Report the buffers of a component outside the engine (activation checkpointing's contiguous buffers) in
    every ``memory_report``; ``source()`` returns their bytes by name, each preallocated to its configured size."""
    _BUFFER_SOURCES[name] = source


def buffer_sources() -> dict[str, Callable[[], dict[str, int]]]:
    """The components :func:`register_buffers` registered, by name."""
    return dict(_BUFFER_SOURCES)


