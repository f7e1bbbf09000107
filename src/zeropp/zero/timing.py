"""Where a training step's time goes: compute, exposed communication waits, the optimizer, offload I/O.

Note [time report]. The engine opens a span around each part of a step it runs (``forward``, ``backward``,
``optimizer``, ``offload_io``; spans nest). The communication layer records, per collective, the seconds the
calling thread was blocked in it ("wait") and the seconds from issue to completion ("busy"; Note
[collective time] in ``comm/ledger.py``). A span's compute is its wall time minus the waits recorded while it
was the innermost open span and minus its child spans, so nothing is counted twice:

    step = forward_compute + backward_compute + optimizer_step + offload_io_wait
           + forward_gather_wait + backward_gather_wait + grad_reduce_wait + other_comm_wait + untracked

``untracked`` is the step time outside every span: the caller's own code between ``engine(batch)`` and
``engine.backward`` (a loss function, logging, freeing the last micro-batch's graph when it rebinds its
loss). Every public call of the engine does its work inside a span, input casts and ``step()``'s checks
included, so nothing of the engine's lands there. A step runs from the first span after the previous
``step()`` to the end of the ``step()`` that applies the optimizer, so gradient accumulation windows count
as one step; only a forward or backward opens a step (offload waits of a checkpoint load between steps are
not a step's time).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from zeropp.comm.ledger import CommLedger, Link, Phase

__all__ = ["StepTimer", "format_time_report"]

# span name -> the report key of its own (exclusive) compute time
_COMPUTE_KEY = {"forward": "forward_compute", "backward": "backward_compute", "optimizer": "optimizer_step",
                "offload_io": "offload_io_wait"}
# a collective's phase -> the report key of its exposed wait
_WAIT_KEY = {Phase.FORWARD_GATHER: "forward_gather_wait", Phase.BACKWARD_GATHER: "backward_gather_wait",
             Phase.GRAD_REDUCE: "grad_reduce_wait", Phase.OTHER: "other_comm_wait"}
_OPENS_STEP = ("forward", "backward")
PHASES = ("forward_compute", "forward_gather_wait", "backward_compute", "backward_gather_wait",
          "grad_reduce_wait", "optimizer_step", "other_comm_wait", "offload_io_wait", "untracked")


WARM_UP_STEPS = 2  # steps left out of the throughput, as DeepSpeed's ThroughputTimer leaves them out


@dataclass
class _Open:
    name: str
    start: float
    waits_at_start: float
    child_wall: float = 0.0
    child_waits: float = 0.0


@dataclass
class StepTimer:
    """Accumulates the current step's breakdown from spans and the ledger's waits; see Note [time report]."""

    ledger: CommLedger
    _stack: list[_Open] = field(default_factory=list)
    _parts: dict[str, float] = field(default_factory=dict)
    _step_start: Optional[float] = None
    _before_step: dict[tuple[str, Phase, Link], float] = field(default_factory=dict)  # times recorded before it
    _last: dict[str, object] = field(default_factory=dict)
    steps: int = 0  # steps closed so far
    warm_steps: int = 0  # of those, the ones after the first WARM_UP_STEPS (compilation, first-touch allocations)
    warm_seconds: float = 0.0  # their summed wall time

    def _total_waits(self) -> float:
        return sum(v for (kind, _p, _l), v in self.ledger.times.items() if kind == "wait")

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time ``name`` (a key of ``_COMPUTE_KEY``); waits inside it are reported by phase, not as compute."""
        now = time.perf_counter()
        if self._step_start is None:
            if name not in _OPENS_STEP:  # between steps (a checkpoint load's uploads): not a step's time
                yield
                return
            self._step_start = now
            self._before_step = dict(self.ledger.times)  # waits between steps (a checkpoint load) are not its
        opened = _Open(name, now, self._total_waits())
        self._stack.append(opened)
        try:
            yield
        finally:
            self._stack.pop()
            waits = self._total_waits() - opened.waits_at_start
            wall = time.perf_counter() - opened.start  # after the bookkeeping: the span's own cost is tracked
            own = wall - opened.child_wall - (waits - opened.child_waits)
            key = _COMPUTE_KEY[name]
            self._parts[key] = self._parts.get(key, 0.0) + max(0.0, own)
            if self._stack:
                self._stack[-1].child_wall += wall
                self._stack[-1].child_waits += waits

    def reset(self) -> None:
        """Forget the current step (the engine's set-up is not a step)."""
        self._stack, self._parts, self._step_start, self._before_step = [], {}, None, {}

    def close_step(self) -> None:
        """End the step (call after the ledger's ``close_step``): snapshot the breakdown for :meth:`report`."""
        end = time.perf_counter()
        step = end - self._step_start if self._step_start is not None else 0.0
        led = self.ledger
        parts = {key: self._parts.get(key, 0.0) for key in PHASES}
        def seconds(kind: str, phase: Phase, link: Optional[Link] = None) -> float:
            earlier = sum(v for (k, p, ln), v in self._before_step.items()
                          if k == kind and p == phase and link in (None, ln))
            return max(0.0, led.seconds(kind, phase, link) - earlier)

        for phase, key in _WAIT_KEY.items():
            parts[key] = seconds("wait", phase)
        parts["untracked"] = max(0.0, step - sum(v for k, v in parts.items() if k != "untracked"))
        exposed = sum(parts[k] for k in _WAIT_KEY.values())
        self._last = {
            "step_s": step,
            "phases_s": parts,
            "grad_reduce_wait_by_link_s": {link.value: seconds("wait", Phase.GRAD_REDUCE, link) for link in Link},
            "collective_busy_s": {phase.value: seconds("busy", phase) for phase in Phase},
            "exposed_comm_s": exposed,
            "exposed_comm_fraction": exposed / step if step > 0 else 0.0,
        }
        self._parts, self._step_start, self._before_step = {}, None, {}
        self.steps += 1
        if self.steps > WARM_UP_STEPS:
            self.warm_steps += 1
            self.warm_seconds += step

    def report(self) -> dict[str, object]:
        """The last completed step's breakdown (empty before the first step)."""
        return dict(self._last)


def format_time_report(report: dict[str, object], step: int) -> str:
    """One log line: step time, then each nonzero part in milliseconds and its share of the step."""
    if not report:
        return f"step {step}: no completed step yet"
    total = float(report["step_s"])  # type: ignore[arg-type]
    parts = report["phases_s"]
    assert isinstance(parts, dict)
    shown = ", ".join(f"{k} {1e3 * v:.1f} ms ({100 * v / total:.0f}%)" for k, v in parts.items()
                      if v > 0 and total > 0)
    return (f"step {step}: {1e3 * total:.1f} ms; {shown}; exposed communication "
            f"{100 * float(report['exposed_comm_fraction']):.0f}%")  # type: ignore[arg-type]
