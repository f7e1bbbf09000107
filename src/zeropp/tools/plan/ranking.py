"""Evaluate every candidate configuration and rank them: fitting ones by predicted step time, then the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from zeropp.tools.plan.choices import Choice, candidates, config_json
from zeropp.tools.plan.hardware import Hardware
from zeropp.tools.plan.memory import Memory, memory
from zeropp.tools.plan.model import ModelSpec
from zeropp.tools.plan.schedule import StepTime, Workload, step_time

TIE = 0.01  # relative step-time difference below which two configurations count as equally fast


@dataclass(frozen=True)
class Row:
    """One configuration's prediction."""

    choice: Choice
    time: StepTime
    memory: Memory
    fits: bool
    tokens_per_s: float

    @property
    def inter_bytes(self) -> int:
        return sum(v["inter_node_bytes"] for v in self.time.volumes.values())


def evaluate(model: ModelSpec, choice: Choice, hw: Hardware, work: Workload) -> Row:
    t = step_time(model, choice, hw, work)
    mem = memory(model, choice, hw.world, work.micro_batch, work.seq_len, work.bucket, work.checkpointing,
                 work.bf16, separate_device=not hw.device_is_host)
    tokens = work.tokens * work.grad_accum * hw.world
    return Row(choice, t, mem, mem.need <= hw.memory_bytes, tokens / t.step_s if t.step_s > 0 else float("inf"))


def rank(model: ModelSpec, hw: Hardware, work: Workload, choices: Optional[list[Choice]] = None) -> list[Row]:
    """Every candidate (default: :func:`choices.candidates`): fitting rows first, fastest first, except that
    rows within ``TIE`` of the fastest are ordered by the memory they need, then by fewer ZeRO++ techniques."""
    choices = choices if choices is not None else candidates(hw.ranks_per_node, hw.world)
    rows = sorted((evaluate(model, c, hw, work) for c in choices), key=lambda r: (not r.fits, r.time.step_s))
    if not rows or not rows[0].fits:
        return rows
    # Within TIE of the fastest the prediction cannot tell them apart: the one needing less memory goes first,
    # then the one with fewer ZeRO++ techniques (no quantization error for nothing): plain ZeRO-3 before + hpZ
    # or + qgZ when compute hides the communication anyway.
    limit = rows[0].time.step_s * (1 + TIE)
    close = [r for r in rows if r.fits and r.time.step_s <= limit]
    return sorted(close, key=lambda r: (r.memory.need, r.choice.techniques, r.time.step_s)) + \
        [r for r in rows if r not in close]


def prefetch_bounds(model: ModelSpec, world: int) -> tuple[int, int]:
    """``(stage3_prefetch_bucket_size, stage3_max_live_parameters)`` that let the engine prefetch every unit, as
    the plan assumes unless the config sets them: at least the engine's defaults."""
    from zeropp.partition.spec import ShardSpec

    sizes = [sum(ShardSpec(n, (n,), world).padded for n in u.numels) for u in model.units]
    largest = max(sizes[1:] or sizes)
    return max(50_000_000, largest), max(1_000_000_000, sizes[0] + 2 * largest)


def best_config(rows: list[Row], work: Workload, ranks_per_node: int, model: ModelSpec, world: int,
                base: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The config JSON of the fastest fitting row (None when nothing fits)."""
    top = next((r for r in rows if r.fits), None)
    if top is None:
        return None
    bucket = work.bucket if base is None or "reduce_bucket_size" not in (base.get("zero_optimization") or {}) \
        else None
    prefetch = prefetch_bounds(model, world) if work.prefetch_bucket is None and work.max_live is None else None
    return config_json(top.choice, work.micro_batch, work.grad_accum, ranks_per_node, base, bucket, work.bf16,
                       prefetch)
