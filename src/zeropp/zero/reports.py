"""The engine's read-only reports: bytes per step, where the step's time went, residual memory (ZeRO-R: buffers
with their bounds, saved activations, gathered weights), model states and NVMe offload. Each is a function over
the engine's state (Note [engine state]) and the parts it reads, given explicitly; the engine's methods of the
same names call them, and none changes what it reads.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from zeropp.config.policy import BUCKETS_IN_FLIGHT, largest_bucket
from zeropp.zero.budget import GROUP_ELEMENTS, unit_elements
from zeropp.zero.gathers import coalesces
from zeropp.zero.grad_intake import GradIntake
from zeropp.zero.memory import ActivationMeter, buffer_sources
from zeropp.zero.state import EngineState


def comm_report(state: EngineState) -> dict[str, dict[str, int]]:
    """Bytes this rank received in the last completed step, by phase and link."""
    return state.ledger.last_step_report()


def time_report(state: EngineState) -> dict[str, Any]:
    """Where the last completed step's wall time went (Note [time report] in ``zero/timing.py``).

    ``phases_s``: forward/backward compute, exposed waits for forward and backward gathers, gradient
    reduction and other collectives, the optimizer step, offload I/O waits, and time outside the engine
    (``untracked``), summing to ``step_s``; ``grad_reduce_wait_by_link_s`` splits the reduction wait by
    link (qgZ's intra-node and inter-node hops); ``collective_busy_s`` is issue-to-completion time per
    phase, hidden or not; ``exposed_comm_fraction`` is the waits' share of the step. Times are the host
    thread's: with NCCL on CUDA a wait only orders streams, so waits read near zero there.
    """
    return state.timer.report()


def offload_report(state: EngineState) -> dict[str, Any]:
    """NVMe offload: bytes held in the per-rank files, the swap buffers' budget and the most they held
    in memory at once, and the files' paths (all 0 / empty without NVMe)."""
    r = state.residency
    return {"offloaded_bytes": r.offloaded_bytes(), "buffer_budget_bytes": r.budget(),
            "buffer_peak_bytes": r.resident_peak(), "files": r.files()}


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
GATHERS_IN_FLIGHT = 2  # the gather being finished and one prefetch (Gathers._prefetch)


def _line(nbytes: int, bound: int, bound_by: str, parts: Optional[dict[str, int]] = None) -> dict[str, Any]:
    line: dict[str, Any] = {"bytes": nbytes, "bound": bound, "bound_by": bound_by}
    if parts:
        line["parts"] = parts
    return line


def gather_bytes_per_element(itemsize: int) -> int:
    """Upper bound of a gather strategy's buffer bytes per element of one gathered unit (Note [buffer bounds])."""
    return 2 * itemsize + 8


def buffer_lines(state: EngineState, grads: GradIntake) -> dict[str, dict[str, Any]]:
    """Every temporary buffer the engine owns now, with its bound (Note [buffer bounds])."""
    itemsize = state.budget.itemsize
    units = state.units
    unit_max = max((unit_elements(u) for u in units), default=0)
    trainable = [s.spec.padded for u in units if u.steps for s in u.slots if s.param.requires_grad]
    bucket = min(largest_bucket(state.policy.reduce_bucket_size, max(trainable, default=0)), sum(trainable))
    lines: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for name, strategy in (("forward_gather", state.strategies.forward_gather),
                           ("backward_gather", state.strategies.backward_gather)):
        if id(strategy) in seen:
            continue
        seen.add(id(strategy))
        parts = strategy.buffer_bytes()
        coalesced = coalesces(state, strategy)
        size = max(unit_max, GROUP_ELEMENTS) if coalesced else unit_max
        what = "the largest unit" if size == unit_max else "a group of small units (Note [gather groups])"
        lines[name] = _line(sum(parts.values()), GATHERS_IN_FLIGHT * size * gather_bytes_per_element(itemsize),
                            f"{GATHERS_IN_FLIGHT} gathers x {what} ({size} elements) x "
                            f"{gather_bytes_per_element(itemsize)} B", parts)
    if not grads.buckets.direct:  # a world of one reduces nothing and has no bucket
        parts = state.strategies.reduce.buffer_bytes()
        per_bucket = state.strategies.reduce.buffer_bound(bucket, _most_in(bucket, trainable), itemsize)
        lines["reduce"] = _line(sum(parts.values()), BUCKETS_IN_FLIGHT * per_bucket,
                                f"{BUCKETS_IN_FLIGHT} buckets x the working set of a bucket of {bucket} elements "
                                f"({per_bucket} B)", parts)
        lines["grad_buckets"] = _line(grads.buffer_bytes(), BUCKETS_IN_FLIGHT * bucket * itemsize,
                                      f"{BUCKETS_IN_FLIGHT} buckets x {bucket} elements x {itemsize} B "
                                      f"(reduce_bucket_size {state.policy.reduce_bucket_size}: Note [bucket size])")
    for name, source in buffer_sources().items():
        parts = source()
        lines[name] = _line(sum(parts.values()), sum(parts.values()), "preallocated to its configured size",
                            parts)
    return lines


def _most_in(bucket: int, sizes: list[int]) -> int:
    """A bound on the parameters one bucket of ``bucket`` elements holds: as many as the smallest of ``sizes``
    (padded elements) fit, however many the model has."""
    return max(1, bucket // max(min(sizes, default=1), 1))


def memory_report(state: EngineState, grads: GradIntake, activations: ActivationMeter,
                  optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``engine.memory_report()``: ZeRO-R's residual memory on this rank: every temporary buffer with its bytes and
    bound, the peak of saved activations and of gathered weights in the last step, and model states.

    ``peak_bytes`` adds the last step's peaks of saved activations (on the compute device) and of gathered
    weights to the model states held now and to the buffers: an upper estimate of the step's peak, since the
    peaks need not coincide. On CUDA ``cuda_max_allocated`` is torch's own counter (everything allocated,
    since its last reset).
    """
    buffers = buffer_lines(state, grads)
    states = model_state_bytes(state, grads, optimizer)
    saved: dict[str, Any] = dict(activations.report())
    device = state.device
    saved["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    nvme = state.residency
    offload = {"resident_peak_bytes": nvme.resident_peak(), "budget_bytes": nvme.budget()}
    gathered_peak = state.budget.peak_bytes()
    buffer_bytes = sum(line["bytes"] for line in buffers.values())
    return {
        "buffers": buffers,
        "buffer_bytes": buffer_bytes,
        "buffer_bound": sum(line["bound"] for line in buffers.values()),
        "activations": saved,
        "gathered_weights_peak": gathered_peak,
        "model_states": states,
        "nvme_swap": offload,
        "peak_bytes": states["total"] - states["gathered_params"] + max(gathered_peak, states["gathered_params"])
        + buffer_bytes + saved["saved_peak_device"],
    }


def model_state_bytes(state: EngineState, grads: GradIntake, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the model-state tensors this rank holds, by kind, measured from the tensors (each storage counted
    once). Unseen by torch-function modes: a measurement reads no weights.

    ``gathered_params`` are full weights (resident in stages 0-2; 0 between steps in stage 3),
    ``full_grads`` whole gradients accumulating before the boundary (stages 0-1) and ``bucket_grads`` whole
    gradients waiting in reduce buckets and reduced rows still on their way to the host (during
    backward), ``reduce_state`` what the reduce strategy keeps between steps (LoCo's errors).
    ``shard_16bit`` includes the host row staged for upload under optimizer offload from a
    separate device. Tensors offloaded to NVMe hold no memory and count 0 here (see :func:`offload_report`).

    Optimizer state counts the tensors shaped like a shard (Adam's moments, SGD's momentum); per
    parameter scalars such as Adam's step counter are bookkeeping, not model state, and are left out.
    """
    with torch._C.DisableTorchFunction():
        return _model_state_bytes(state, grads, optimizer)


def _model_state_bytes(state: EngineState, grads: GradIntake, optimizer: torch.optim.Optimizer) -> dict[str, int]:
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
        "master_fp32": sum(size(u.master) for u in state.units if u.holds_master),
        "shard_16bit": sum(size(u.kept_shard) + size(u.staged_row) for u in state.units),
        "grad_shard": sum(size(u.grad) for u in state.units),
        "optimizer_state": 0,
        "gathered_params": sum(size(s.full) for u in state.units for s in u.slots),
        "full_grads": sum(size(s.param.grad) for u in state.units for s in u.slots),
        "bucket_grads": grads.buckets.held_bytes(),
        "frozen_quantized": sum(size(u.quantized_state()) for u in state.units),
    }
    for per_param in optimizer.state.values():
        for t in per_param.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                out["optimizer_state"] += size(t)
    strategies = state.strategies
    held = strategies.forward_gather.held_tensors() + strategies.backward_gather.held_tensors()
    out["hpz_secondary"] = sum(size(t) for t in held)
    out["reduce_state"] = sum(size(t) for t in _tensors_in(strategies.reduce.state_dict()))
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
