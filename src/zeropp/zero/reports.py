"""The engine's read-only reports: bytes per step, where the step's time went, residual memory, model states
and NVMe offload. Each is a function over the engine's state (the engine's methods of the same names); none
changes what it does."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeropp.zero import memory

if TYPE_CHECKING:
    from zeropp.zero.engine import ZeroEngine


def comm_report(engine: ZeroEngine) -> dict[str, dict[str, int]]:
    """Bytes this rank received in the last completed step, by phase and link."""
    return engine.ledger.last_step_report()


def time_report(engine: ZeroEngine) -> dict[str, Any]:
    """Where the last completed step's wall time went (Note [time report] in ``zero/timing.py``).

    ``phases_s``: forward/backward compute, exposed waits for forward and backward gathers, gradient
    reduction and other collectives, the optimizer step, offload I/O waits, and time outside the engine
    (``untracked``), summing to ``step_s``; ``grad_reduce_wait_by_link_s`` splits the reduction wait by
    link (qgZ's intra-node and inter-node hops); ``collective_busy_s`` is issue-to-completion time per
    phase, hidden or not; ``exposed_comm_fraction`` is the waits' share of the step. Times are the host
    thread's: with NCCL on CUDA a wait only orders streams, so waits read near zero there.
    """
    return engine.timer.report()


def memory_report(engine: ZeroEngine) -> dict[str, Any]:
    """ZeRO-R's residual memory on this rank (``zero/memory.py``): every temporary buffer with its bytes and
    bound, the peak of saved activations and of gathered weights in the last step, and model states."""
    return memory.memory_report(engine)


def model_state_bytes(engine: ZeroEngine) -> dict[str, int]:
    """Bytes of the model-state tensors this rank holds, by kind, measured from the tensors.

    ``gathered_params`` are full weights (resident in stages 0-2; 0 between steps in stage 3),
    ``full_grads`` whole gradients accumulating before the boundary (stages 0-1) and ``bucket_grads`` whole
    gradients waiting in reduce buckets and reduced rows still on their way to the host (during
    backward), ``reduce_state`` what the reduce strategy keeps between steps (LoCo's errors).
    ``shard_16bit`` includes the host row staged for upload under optimizer offload from a
    separate device. Tensors offloaded to NVMe hold no memory and
    count 0 here (see :meth:`offload_report`).

    Optimizer state counts the tensors shaped like a shard (Adam's moments, SGD's momentum); per
    parameter scalars such as Adam's step counter are bookkeeping, not model state, and are left out.
    """
    return memory.model_state_bytes(engine)


def offload_report(engine: ZeroEngine) -> dict[str, Any]:
    """NVMe offload: bytes held in the per-rank files, the swap buffers' budget and the most they held
    in memory at once, and the files' paths (all 0 / empty without NVMe)."""
    r = engine.residency
    return {"offloaded_bytes": r.offloaded_bytes(), "buffer_budget_bytes": r.budget(),
            "buffer_peak_bytes": r.resident_peak(), "files": r.files()}
