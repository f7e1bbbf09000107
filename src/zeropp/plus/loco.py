"""LoCo error feedback for qgZ: what a quantization lost in one step is added back before the next.

Note [LoCo error feedback]: LoCo (arXiv 2407.04480; DeepSpeed's ``zeropp_loco_param``) keeps, for every
value a rank quantizes, the error it made: before quantizing ``g`` it quantizes ``x = g + e`` instead, and
afterwards keeps ``e <- beta * e + (1 - beta) * (x - deq(q(x)))``. Every ``reset_T`` optimizer steps the
errors are zeroed. What one step rounds away is sent in a later step, so the sum over steps of what arrives
tracks the sum of the true gradients instead of drifting by a biased rounding error each step; that is what
lets 2-bit gradients converge.

Who keeps what. A rank quantizes at two places (``plus/qgz.py``): its own gradient bucket, ``[W, L]``, at
the first hop that runs (``FIRST``), and the ``n`` partial sums of its node, ``[n, L]``, before the
inter-node hop (``SECOND``, only when there are both several nodes and several ranks per node). Each rank
keeps exactly the errors of what it quantized: ``W * L`` and ``n * L`` values per bucket, i.e. about ``M``
and ``M / D`` for a model of ``M`` elements with ``D`` ranks per node. Nothing else can be sharded further:
the first error is of this rank's own gradient, which no other rank ever sees, so no rank can hold it in
its place. DeepSpeed keeps the same two buffers; it does not checkpoint them, and keys them to parameter
objects. Here they are kept per parameter name, stored as int8 blocks (the block size of the quantizer,
blocks never crossing parameters) and saved in checkpoints (``state_dict``), so a resume on the same
topology continues bit for bit; ``map_states`` carries them to another topology.

Errors are kept in the units the gradient buckets hold (the micro-batch gradient, scaled by
``1 / gradient_accumulation_steps`` and by the fp16 loss scale); when the loss scale moves, the kept errors
are rescaled with it (``end_step``). A block whose compensated value is not
finite (an overflow step, which the engine skips) keeps its old error instead of a NaN one. The fp32
temporaries of a compensated bucket (``x``, the kept and the decoded values) are allocated per bucket: LoCo
is not on the pooled hot path of Note [buffer pool].
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from zeropp.quant import BlockLayout, QuantizedRows, dequantize, quantize

STATE_BITS = 8  # the kept errors are stored as int8 blocks


class Stage(enum.Enum):
    FIRST = "first"  # this rank's own gradient rows, [W, L], in bucket-row (destination rank) order
    SECOND = "second"  # this node's partial sums for the ranks with this local index, [n, L]


@dataclass(frozen=True)
class BucketKeys:
    """Which parameter chunks make up a bucket row: their names and lengths, in order."""

    names: tuple[str, ...]
    segments: tuple[int, ...]


@dataclass
class Compensated:
    """``x = values + kept``: what is quantized, and the error it was compensated with."""

    x: torch.Tensor
    kept: torch.Tensor


@dataclass
class ErrorMemory:
    """The errors one stage keeps: per parameter name, ``rows x chunk`` values stored as int8 blocks."""

    block: int
    kept: dict[str, QuantizedRows] = field(default_factory=dict)

    def read(self, keys: BucketKeys, rows: int, device: torch.device) -> torch.Tensor:
        """The kept errors of ``keys`` as one fp32 ``[rows, L]`` tensor (zeros where nothing is kept)."""
        out = torch.zeros(rows, sum(keys.segments), dtype=torch.float32, device=device)
        off = 0
        for name, c in zip(keys.names, keys.segments):
            q = self.kept.get(name)
            if q is not None and c:
                if q.data.shape[0] != rows:
                    raise ValueError(f"LoCo: the kept error of {name!r} has {q.data.shape[0]} rows, the bucket "
                                     f"{rows}: the topology changed without map_states")
                out[:, off : off + c] = dequantize(q, BlockLayout((c,), self.block), STATE_BITS, torch.float32)
            off += c
        return out

    def write(self, keys: BucketKeys, errors: torch.Tensor) -> None:
        off = 0
        for name, c in zip(keys.names, keys.segments):
            if c:
                part = errors[:, off : off + c].contiguous()
                self.kept[name] = quantize(part, BlockLayout((c,), self.block), STATE_BITS)
            off += c

    def nbytes(self) -> int:
        return sum(q.data.numel() + q.scales.numel() * 4 for q in self.kept.values())

    def as_dense(self) -> dict[str, torch.Tensor]:
        """Each kept error dequantized to fp32 ``[rows, chunk]`` (for mapping and tests)."""
        # int8 stores one byte per element, so a row's payload length is the chunk length
        return {name: dequantize(q, BlockLayout((q.data.shape[1],), self.block), STATE_BITS, torch.float32)
                for name, q in self.kept.items()}


class Loco:
    """Error feedback state of one rank: both stages' memories, the step counter and the settings."""

    def __init__(self, err_beta: float, reset_T: int, block: int) -> None:
        if not 0.0 <= err_beta < 1.0:
            raise ValueError(f"LoCo: err_beta must be in [0, 1), got {err_beta!r}")
        if reset_T < 1:
            raise ValueError(f"LoCo: reset_T must be >= 1, got {reset_T!r}")
        self.beta, self.reset_T, self.block = float(err_beta), int(reset_T), int(block)
        self.memories = {s: ErrorMemory(self.block) for s in Stage}
        self.steps = 0  # optimizer steps since the last reset

    def compensate(self, stage: Stage, keys: BucketKeys, values: torch.Tensor) -> Compensated:
        """``values`` ([rows, L], any float dtype) plus the kept error of ``stage``, in fp32."""
        kept = self.memories[stage].read(keys, values.shape[0], values.device)
        return Compensated(values.to(torch.float32) + kept, kept)

    def keep(self, stage: Stage, keys: BucketKeys, comp: Compensated, sent: torch.Tensor) -> None:
        """Keep ``beta * kept + (1 - beta) * (x - sent)``; ``sent`` is what ``x`` dequantizes to."""
        new = comp.x - sent
        new.mul_(1.0 - self.beta).add_(comp.kept, alpha=self.beta)
        # an overflow (inf/nan gradient, a skipped step) must not poison every later step
        new = torch.where(torch.isfinite(new), new, comp.kept)
        self.memories[stage].write(keys, new)

    def end_step(self, grad_scale: float = 1.0) -> None:
        """Called after each optimizer step: zero the errors every ``reset_T`` steps; else, when the fp16 loss
        scale moved (``grad_scale`` = new / old), bring them to the new scale, as the gradients will be."""
        self.steps += 1
        if self.steps >= self.reset_T:
            self.steps = 0
            for memory in self.memories.values():
                memory.kept.clear()
        elif grad_scale != 1.0:
            for memory in self.memories.values():
                for q in memory.kept.values():
                    q.scales.mul_(grad_scale)  # int8 codes times a scale: scaling the scales scales the values

    def nbytes(self) -> dict[str, int]:
        return {f"loco_{s.value}": m.nbytes() for s, m in self.memories.items()}

    def state_dict(self) -> dict:
        return {
            "steps": self.steps, "block": self.block,
            **{s.value: {n: (q.data, q.scales) for n, q in m.kept.items()} for s, m in self.memories.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["block"]) != self.block:
            raise ValueError(f"LoCo: the saved errors use blocks of {state['block']}, this run {self.block}")
        self.steps = int(state["steps"])
        for s, m in self.memories.items():
            m.kept = {n: QuantizedRows(d, sc) for n, (d, sc) in state[s.value].items()}


def keys_of(names: Sequence[str], segments: Sequence[int]) -> BucketKeys:
    """The bucket's keys; error feedback needs every chunk named (the engine's buckets name them)."""
    if len(names) != len(segments):
        raise ValueError(f"LoCo: {len(segments)} bucket segments but {len(names)} parameter names; error "
                         "feedback keeps its errors per parameter and needs every chunk named")
    return BucketKeys(tuple(names), tuple(int(s) for s in segments))


# ---- another topology ------------------------------------------------------------------------------------
# Note [mapping kept errors]: an error ``e`` kept by any one of the W ranks adds ``e / W`` to the mean the
# next reduction delivers, whichever rank keeps it: the reduction is linear. So what must survive a change of
# topology is, per element of each parameter, the total "debt" ``sum(e) / W``. The first stage's debt is
# carried rank group by rank group (new rank p' takes the old ranks p = p' mod W', scaled by W'/W); the second
# stage's, summed per element over its old holders, is split evenly over the new holders of that element's
# destination (the n' ranks with its local index), or over every new rank's first stage when the new
# topology has no second stage. Each element's debt is preserved exactly (before int8 storage rounds it).


@dataclass(frozen=True)
class Shape:
    """A topology as LoCo sees it: ``nodes`` x ``per_node`` ranks."""

    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def has_second(self) -> bool:
        return self.nodes > 1 and self.per_node > 1


def map_states(old: list[dict], old_shape: Shape, new_shape: Shape, rank: int,
               sizes: dict[str, tuple[int, int]], block: int) -> dict:
    """The ``Loco.state_dict()`` rank ``rank`` of ``new_shape`` gets from every old rank's (Note [mapping kept
    errors]); ``sizes``: each parameter's element count and chunk on the new topology."""
    w_old, w_new = old_shape.world, new_shape.world
    first: dict[str, torch.Tensor] = {}
    second: dict[str, torch.Tensor] = {}
    kept = {n for state in old for s in Stage for n in state.get(s.value, {})}
    for name in sorted(kept & sizes.keys()):
        numel, chunk = sizes[name]
        debt1 = _group_debt(old, name, numel, rank, w_new) * (w_new / w_old)
        debt2 = _second_debt(old, old_shape, name, numel) * (w_new / w_old)
        first[name] = _pad(debt1, w_new * chunk).view(w_new, chunk)
        if new_shape.has_second:
            j = rank % new_shape.per_node
            rows = [k * new_shape.per_node + j for k in range(new_shape.nodes)]
            second[name] = _pad(debt2 / new_shape.nodes, w_new * chunk).view(w_new, chunk)[rows]
        else:
            first[name] += _pad(debt2 / w_new, w_new * chunk).view(w_new, chunk)
    loco = Loco(0.0, 1, block)
    for stage, dense in ((Stage.FIRST, first), (Stage.SECOND, second)):
        for name, e in dense.items():
            loco.memories[stage].write(BucketKeys((name,), (e.shape[1],)), e)
    loco.steps = int(old[0]["steps"])
    return loco.state_dict()


def _dense(state: dict, stage: Stage, name: str, block: int) -> Optional[torch.Tensor]:
    kept = state.get(stage.value, {}).get(name)
    if kept is None:
        return None
    data, scales = kept
    return dequantize(QuantizedRows(data, scales), BlockLayout((data.shape[1],), block), STATE_BITS,
                      torch.float32)


def _group_debt(old: list[dict], name: str, numel: int, rank: int, w_new: int) -> torch.Tensor:
    """The first-stage errors of the old ranks ``p = rank mod w_new``, summed, as a flat ``[numel]`` tensor."""
    total = torch.zeros(numel)
    for p in range(rank, len(old), w_new):
        e = _dense(old[p], Stage.FIRST, name, int(old[p]["block"]))
        if e is not None:
            total += e.reshape(-1)[:numel]
    return total


def _second_debt(old: list[dict], shape: Shape, name: str, numel: int) -> torch.Tensor:
    """Every old rank's second-stage errors, summed per element of the parameter (flat ``[numel]``)."""
    total = torch.zeros(0)
    for p, state in enumerate(old):
        e = _dense(state, Stage.SECOND, name, int(state["block"]))
        if e is None:
            continue
        chunk = e.shape[1]
        if total.numel() == 0:
            total = torch.zeros(shape.world * chunk)
        j = p % shape.per_node
        for k in range(e.shape[0]):  # row k: the destination k * D + j
            dest = k * shape.per_node + j
            total[dest * chunk : (dest + 1) * chunk] += e[k]
    return total[:numel] if total.numel() else torch.zeros(numel)


def _pad(flat: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size)
    out[: flat.numel()] = flat
    return out


def element_debt(states: list[dict], shape: Shape, name: str, numel: int) -> torch.Tensor:
    """Per element of parameter ``name``: ``sum(e) / W`` over every rank's kept errors (``states``, one
    ``Loco.state_dict()`` per rank of ``shape``): what they add to the next mean. ``map_states`` keeps it."""
    total = _second_debt(states, shape, name, numel).clone()
    for state in states:
        e = _dense(state, Stage.FIRST, name, int(state["block"]))
        if e is not None:
            total += e.reshape(-1)[:numel]
    return total / shape.world
