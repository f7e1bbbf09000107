"""ZeRO-R's residual memory on one rank: the activations saved for backward, the engine's temporary buffers,
and the model states beside them (``engine.memory_report()``).

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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from zeropp.config.policy import BUCKETS_IN_FLIGHT, largest_bucket
from zeropp.partition.unit import Unit

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

    ``excluded()`` returns the storage keys that are not activations (weights, module buffers); it is called
    each time :meth:`watching` starts. ``last_step`` holds the peaks of the last closed step.
    """

    def __init__(self, excluded: Callable[[], set[int]]) -> None:
        self._excluded = excluded
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
        excluded = self._excluded()
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


def unit_elements(unit: Unit) -> int:
    """Elements of ``unit``'s full (padded) weights once gathered."""
    return sum(s.spec.padded for s in unit.slots)


@dataclass
class GatheredWeights:
    """Stage 3's full weights gathered on this rank: how many elements now, their peak per step, and whether a
    prefetch fits DeepSpeed's bounds.

    ``max_live`` (``stage3_max_live_parameters``) bounds the elements gathered plus in flight when a prefetch
    starts, and ``prefetch_bucket`` (``stage3_prefetch_bucket_size``) the elements one prefetch may bring;
    0 turns prefetching off, as in DeepSpeed. A gather the model needs now is never refused: the bounds
    apply to gathers started ahead of use (the engine prefetches one unit ahead; a two-hop gather's first hop
    two units ahead, counted with the unit between).
    """

    max_live: int
    prefetch_bucket: int
    itemsize: int
    live: int = 0
    peak: int = 0
    last_step_peak: Optional[int] = None
    _units: set[Unit] = field(default_factory=set)

    def gathered(self, unit: Unit) -> None:
        if unit not in self._units:
            self._units.add(unit)
            self.live += unit_elements(unit)
            self.peak = max(self.peak, self.live)

    def released(self, unit: Unit) -> None:
        if unit in self._units:
            self._units.discard(unit)
            self.live -= unit_elements(unit)

    def admits(self, unit: Unit, *gathering: Unit) -> bool:
        """Whether a prefetch of ``unit`` fits while ``gathering`` (not counted yet) are being gathered."""
        return self.admits_elements(unit_elements(unit), *gathering)

    def admits_elements(self, need: int, *gathering: Unit) -> bool:
        """Whether a prefetch of ``need`` elements (a unit, or units in one collective) fits while ``gathering``
        are being gathered."""
        return need <= self.prefetch_bucket and \
            self.live + sum(unit_elements(u) for u in gathering) + need <= self.max_live

    def close_step(self) -> None:
        self.last_step_peak, self.peak = self.peak, self.live

    def peak_bytes(self) -> int:
        peak = self.last_step_peak if self.last_step_peak is not None else self.peak
        return peak * self.itemsize


def weight_storages(module: torch.nn.Module) -> set[int]:
    """Storage keys of ``module``'s parameters and buffers: saved tensors that are not activations. Call it
    outside a stage-3 pass (a parameter's storage is its unit's full buffer, the same object while it is
    resized; reading it inside the pass would count as a read of the weights)."""
    keys = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
    keys.discard(None)
    return keys  # type: ignore[return-value]


# ---- buffers and their bounds ---------------------------------------------------------------------------
# Note [buffer bounds]: the engine's temporary buffers come from the strategies' pools (Note [buffer pool] in
# comm/buffers.py): a role holds as many slabs as it ever had leases at once, each as large as its largest
# request. Requests are one unit's gather or one gradient bucket, and the engine keeps at most
# GATHERS_IN_FLIGHT gathers and BUCKETS_IN_FLIGHT buckets in flight, so every pool is bounded by the largest
# unit (a unit is gathered whole: the model's own working set) or by reduce_bucket_size, never by the number of
# units. Per element of one gather, summed over a strategy's roles: the compute-dtype rows it returns and, with
# hpZ, the secondary gather's rows (2 x itemsize); quantized wire rows, sent and received, at most 1 byte of
# payload and 2 bytes of fp32 scale per element each (a chunk holds at least 2 elements, Note [shard layout]),
# a two-hop gather's first-hop rows (1/D of the received ones, Note [two-hop gather] in comm/gather.py), and the
# decoded scales (<= 8 bytes in all). A reduction's bound is its strategy's ``buffer_bound`` of the largest
# bucket (Note [bucket size] in config/policy.py): the receive rows and the fp32 result row of a plain
# reduce-scatter, the int4 wire rows, scale scratch and result row of qgZ.
GATHERS_IN_FLIGHT = 2  # the gather being finished and one prefetch (ZeroEngine._prefetch)
# Note [gather groups] (``zeropp_coalesced_prefetch``, on by default): over one hop, small units (at most
# GROUP_ELEMENTS gathered, not persistent) are gathered in groups, one collective per group, instead of one each:
# a model of many small units (thin blocks, LoRA adapters in units of their own, stray norms) pays one
# collective's latency per group. A group is gathered whole when its first unit is needed or prefetched (the
# members no gather of the pass has taken yet, that ZeRO-R's bounds admit); each unit still lands (is copied into
# its weights) when it is used, and buffers stay bounded by GROUP_ELEMENTS, never by the number of units. Units
# over GROUP_ELEMENTS are gathered one at a time as before, so models of large blocks see no change; a two-hop
# route, qwZ and hpZ gather one unit at a time. On the launch-bound model (48 blocks of 8,448 elements, 2 ranks
# over loopback) a step's gathers went from 102 collectives to 2 (comm/gather.py's ``AllGather.start_many``).
# Every rank must issue the same collectives, so every rank must hold the same groups. They are formed after each
# optimizer step (``Gathers.regroup``) from the gathers the last forward and the last backward issued: runs of
# distinct small units, at most GROUP_ELEMENTS (and stage3_prefetch_bucket_size) together. The step's collective
# order check has just found those gathers, and where each pass ended, the same on every rank (Note [collective
# order]); a rank's own order of use would not do: a rank that left a frozen block out (a layer drop of its own)
# would form other groups, and its next step's collectives would no longer pair. Until the first step there are
# no groups. A rank that skips a unit gathers it all the same with its group and drains it unused.
# Ranks that run different modules must fail by name, not by a signal: gloo aborts the process when a collective
# brings more bytes than the rank expected. So every collective of small units, a group or a small unit alone
# (gathered again, or in no group), is zero-padded to one length fixed at initialize (the smaller of
# GROUP_ELEMENTS and all small units together, gathered): two ranks that gather different small units issue
# collectives of the same size, and the order check refuses the step by name. Padding costs bytes, not
# collectives: every group but a pass's last is nearly full, and the whole launch-bound model is one group.
GROUP_ELEMENTS = 1 << 20
_BUFFER_SOURCES: dict[str, Callable[[], dict[str, int]]] = {}


def gather_bytes_per_element(itemsize: int) -> int:
    """Upper bound of a gather strategy's buffer bytes per element of one gathered unit (Note [buffer bounds])."""
    return 2 * itemsize + 8


def register_buffers(name: str, source: Callable[[], dict[str, int]]) -> None:
    """Report the buffers of a component outside the engine (activation checkpointing's contiguous buffers) in
    every ``memory_report``; ``source()`` returns their bytes by name, each preallocated to its configured size."""
    _BUFFER_SOURCES[name] = source


def _line(nbytes: int, bound: int, bound_by: str, parts: Optional[dict[str, int]] = None) -> dict[str, Any]:
    line: dict[str, Any] = {"bytes": nbytes, "bound": bound, "bound_by": bound_by}
    if parts:
        line["parts"] = parts
    return line


def buffer_lines(engine: Any) -> dict[str, dict[str, Any]]:
    """Every temporary buffer the engine owns now, with its bound (Note [buffer bounds])."""
    itemsize = engine.gathered_weights.itemsize
    units = engine.units
    unit_max = max((unit_elements(u) for u in units), default=0)
    trainable = [s.spec.padded for u in units if u.steps for s in u.slots if s.param.requires_grad]
    bucket = min(largest_bucket(engine.policy.reduce_bucket_size, max(trainable, default=0)), sum(trainable))
    lines: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for name, strategy in (("forward_gather", engine.strategies.forward_gather),
                           ("backward_gather", engine.strategies.backward_gather)):
        if id(strategy) in seen:
            continue
        seen.add(id(strategy))
        parts = strategy.buffer_bytes()
        coalesced = engine.gathers.coalesces(strategy)
        size = max(unit_max, GROUP_ELEMENTS) if coalesced else unit_max
        what = "the largest unit" if size == unit_max else "a group of small units (Note [gather groups])"
        lines[name] = _line(sum(parts.values()), GATHERS_IN_FLIGHT * size * gather_bytes_per_element(itemsize),
                            f"{GATHERS_IN_FLIGHT} gathers x {what} ({size} elements) x "
                            f"{gather_bytes_per_element(itemsize)} B", parts)
    if not engine.grads.buckets.direct:  # a world of one reduces nothing and has no bucket
        parts = engine.strategies.reduce.buffer_bytes()
        per_bucket = engine.strategies.reduce.buffer_bound(bucket, _most_in(bucket, trainable), itemsize)
        lines["reduce"] = _line(sum(parts.values()), BUCKETS_IN_FLIGHT * per_bucket,
                                f"{BUCKETS_IN_FLIGHT} buckets x the working set of a bucket of {bucket} elements "
                                f"({per_bucket} B)", parts)
        lines["grad_buckets"] = _line(engine.grads.buckets.pool.nbytes(), BUCKETS_IN_FLIGHT * bucket * itemsize,
                                      f"{BUCKETS_IN_FLIGHT} buckets x {bucket} elements x {itemsize} B "
                                      f"(reduce_bucket_size {engine.policy.reduce_bucket_size}: Note [bucket size])")
    for name, source in _BUFFER_SOURCES.items():
        parts = source()
        lines[name] = _line(sum(parts.values()), sum(parts.values()), "preallocated to its configured size",
                            parts)
    return lines


def _most_in(bucket: int, sizes: list[int]) -> int:
    """A bound on the parameters one bucket of ``bucket`` elements holds: as many as the smallest of ``sizes``
    (padded elements) fit, however many the model has."""
    return max(1, bucket // max(min(sizes, default=1), 1))


def memory_report(engine: Any) -> dict[str, Any]:
    """``engine.memory_report()``: buffers with bounds, saved activations, gathered weights, model states.

    ``peak_bytes`` adds the last step's peaks of saved activations (on the compute device) and of gathered
    weights to the model states held now and to the buffers: an upper estimate of the step's peak, since the
    peaks need not coincide. On CUDA ``cuda_max_allocated`` is torch's own counter (everything allocated,
    since its last reset).
    """
    buffers = buffer_lines(engine)
    states = engine.model_state_bytes()
    activations: dict[str, Any] = dict(engine.activations.report())
    device = engine.units[0].device if engine.units else torch.device("cpu")
    activations["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    nvme = engine.residency
    offload = {"resident_peak_bytes": nvme.resident_peak(), "budget_bytes": nvme.budget()}
    gathered_peak = engine.gathered_weights.peak_bytes()
    buffer_bytes = sum(line["bytes"] for line in buffers.values())
    return {
        "buffers": buffers,
        "buffer_bytes": buffer_bytes,
        "buffer_bound": sum(line["bound"] for line in buffers.values()),
        "activations": activations,
        "gathered_weights_peak": gathered_peak,
        "model_states": states,
        "nvme_swap": offload,
        "peak_bytes": states["total"] - states["gathered_params"] + max(gathered_peak, states["gathered_params"])
        + buffer_bytes + activations["saved_peak_device"],
    }


def model_state_bytes(engine: Any) -> dict[str, int]:
    """``engine.model_state_bytes()``: the model-state tensors the rank holds, by kind, measured from the
    tensors (each storage counted once). Unseen by torch-function modes: a measurement reads no weights."""
    with torch._C.DisableTorchFunction():
        return _model_state_bytes(engine)


def _model_state_bytes(engine: Any) -> dict[str, int]:
    seen: set[int] = set()

    def size(t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() == 0:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    out = {
        "master_fp32": sum(size(u.master) for u in engine.units if u.holds_master),
        "shard_16bit": sum(size(u.kept_shard) + size(u.staged_row) for u in engine.units),
        "grad_shard": sum(size(u.grad) for u in engine.units),
        "optimizer_state": 0,
        "gathered_params": sum(size(s.full) for u in engine.units for s in u.slots),
        "full_grads": sum(size(s.param.grad) for u in engine.units for s in u.slots),
        "bucket_grads": engine.grads.buckets.held_bytes(),
        "frozen_quantized": sum(size(u.quantized_state()) for u in engine.units),
    }
    for state in engine.master_optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                out["optimizer_state"] += size(t)
    held = engine.strategies.forward_gather.held_tensors() + engine.strategies.backward_gather.held_tensors()
    out["hpz_secondary"] = sum(size(t) for t in held)
    out["reduce_state"] = sum(size(t) for t in _tensors_in(engine.strategies.reduce.state_dict()))
    out["total"] = sum(out.values())
    return out


def _tensors_in(state: Any) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples (a strategy's ``state_dict()``)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors_in(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors_in(v)]
    return []
