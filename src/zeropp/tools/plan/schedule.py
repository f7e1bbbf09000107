"""One optimizer step replayed as the engine runs it (``zero/engine.py``, ``zero/buckets.py``), with times.

Two kinds of resource per rank: the main thread (compute, quantization, bucket packing, sums, the optimizer)
and two communication channels, one for collectives that cross nodes and one for those inside a node, each
running its collectives in the order they are issued. What the engine overlaps:

* forward: a unit's pre-hook issues its own gather (if not prefetched) and then the next unit's (the order
  recorded in the last pass), then waits for its own: the gather of unit i+1 runs while unit i computes (a
  two-hop world gather's first hop, across nodes, starts two units ahead and its second, inside the node,
  one unit ahead: Note [two-hop gather]). A
  prefetch starts only within ``stage3_prefetch_bucket_size`` (the next unit's padded elements) and
  ``stage3_max_live_parameters`` (gathered + being gathered + the next unit), as ``zero/budget.py`` admits it;
* backward: the same, over the backward order, with the backward strategy (hpZ: the slices, inside a node);
* gradients: a full bucket's reduction is issued and runs while backward continues; the next full bucket
  first completes the one in flight (the main thread waits for it). qgZ's second hop starts once the first
  has arrived, seen when backward next hands the buckets a gradient (Note [overlapped second hop] in
  ``plus/qgz.py``; here: after each unit's backward), else inside that completion; the last buckets complete
  after backward;
* the optimizer step (global norm all-reduce, casts, AdamW, recast) overlaps nothing; stages 1-2 then gather
  the full weights unit by unit, synchronously.

On CPU ranks (``Hardware.comm_uses_compute``) a collective's host time and the compute share the same cores,
so the step also takes at least the sum of all main-thread work and all host time of collectives:
``step = max(replayed time, that sum)``. On accelerators the replayed time is the step time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from zeropp.config.policy import bucket_capacity
from zeropp.partition.spec import ShardSpec
from zeropp.tools.plan import collectives as coll
from zeropp.tools.plan.choices import Choice
from zeropp.tools.plan.hardware import Hardware
from zeropp.tools.plan.model import ModelSpec, UnitSpec, flops_per_step
from zeropp.topology import Layout

_Gather = tuple[float, list[coll.Collective]]  # when a gather's first hop completes, and the hops after it


@dataclass(frozen=True)
class Workload:
    """What one rank trains per optimizer step, and the engine settings that shape the step."""

    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    bucket: int = 500_000_000  # reduce_bucket_size, elements
    block: int = 2048  # quantization_block_size
    bf16: bool = True
    checkpointing: bool = False
    ring_reduce_scatter: bool = False  # model NCCL's ring reduce-scatter (DeepSpeed) instead of zeropp's all-to-all
    # stage3_prefetch_bucket_size / stage3_max_live_parameters (None: large enough for every prefetch, as the
    # plan's config JSON sets them; the engine's defaults are 5e7 and 1e9)
    prefetch_bucket: Optional[int] = None
    max_live: Optional[int] = None

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class _Clock:
    """The main thread's time, each channel's free time, and the tallies the prediction reports.

    Two channels: collectives that cross nodes, and those that stay inside one (hpZ's gathers, qgZ's first
    hop, a two-hop gather's second), which use other links and run at the same time."""

    hw: Hardware
    main: float = 0.0
    channels: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # crosses nodes?
    work: float = 0.0  # main-thread busy seconds
    host_comm: float = 0.0  # host seconds of collectives
    comm: float = 0.0  # channel busy seconds
    waited: float = 0.0  # main-thread seconds spent waiting for a collective
    volumes: dict[str, list[int]] = field(default_factory=dict)  # phase -> [intra, inter] bytes

    def do(self, seconds: float) -> None:
        self.main += seconds
        self.work += seconds

    def issue(self, collectives: list[coll.Collective]) -> float:
        """Queue ``collectives`` back to back, each on its channel; returns when the last one completes."""
        done = self.main
        for c in collectives:
            seconds, host = coll.duration(c, self.hw)
            crosses = c.volume.inter_node_bytes > 0
            start = max(done, self.channels[crosses])
            self.channels[crosses] = done = start + seconds
            self.comm += seconds
            self.host_comm += host
            tally = self.volumes.setdefault(c.phase, [0, 0])
            tally[0] += c.volume.intra_node_bytes
            tally[1] += c.volume.inter_node_bytes
        return done

    def wait(self, done: float) -> None:
        if done > self.main:
            self.waited += done - self.main
            self.main = done


@dataclass(frozen=True)
class StepTime:
    """The predicted step and its parts (seconds), and the bytes it moves per phase (one rank, ledger's)."""

    step_s: float
    replayed_s: float  # the two-resource replay
    cpu_bound_s: float  # all main-thread work + all host time of collectives (CPU ranks; else 0)
    compute_s: float
    host_work_s: float  # quantization, packing, sums, optimizer
    comm_s: float  # channel busy time
    exposed_comm_s: float  # main thread waiting for collectives
    volumes: dict[str, dict[str, int]]


class _Step:
    """Replays one optimizer step of ``choice`` for ``model`` on ``hw``."""

    def __init__(self, model: ModelSpec, choice: Choice, hw: Hardware, work: Workload) -> None:
        self.model, self.choice, self.hw, self.w = model, choice, hw, work
        self.layout = Layout(hw.world, hw.ranks_per_node)
        self.clock = _Clock(hw)
        self.shard_world = hw.world if choice.stage >= 1 else 1
        self.elem = 2 if work.bf16 else 4
        total = flops_per_step(model, work.tokens, work.seq_len, work.checkpointing)
        fwd_tok = max(model.forward_flops_per_token(work.seq_len), 1.0)
        self.compute_of = {u.name: total * u.flops_per_token / fwd_tok / hw.flops for u in model.units}
        attention = total * (1 - sum(u.flops_per_token for u in model.units) / fwd_tok) / hw.flops
        blocks = max(len(model.units) - 1, 1)
        for u in model.units[1:]:  # attention's own FLOPs belong to the blocks
            self.compute_of[u.name] += attention / blocks
        self.fwd_share = 1.0 / (4.0 if work.checkpointing else 3.0)
        self.compute = 0.0

    # ---- main-thread costs ---------------------------------------------------------------------------------
    def chunk(self, numels: tuple[int, ...] | list[int], world: Optional[int] = None) -> int:
        return sum(ShardSpec(n, (n,), world or self.shard_world).chunk for n in numels)

    def quantize(self, elements: float, bits: int) -> None:
        self.clock.do(elements / self.hw.quantize_per_s[bits])

    def dequantize(self, elements: float, bits: int) -> None:
        self.clock.do(elements / self.hw.dequantize_per_s[bits])

    def run_compute(self, seconds: float) -> None:
        self.compute += seconds
        self.clock.do(seconds)

    # ---- passes --------------------------------------------------------------------------------------------
    def forward(self, first_micro: bool) -> None:
        units = self.model.units
        if self.choice.stage < 3:
            for u in units:
                self.run_compute(self.compute_of[u.name] * self.fwd_share)
            return
        current = not first_micro  # hpZ slices are current after this step's first forward
        pending: dict[int, _Gather] = {}
        hops = lambda u: coll.forward_gather(u.numels, self.choice, self.layout, self.w.bf16,  # noqa: E731
                                             self.w.block, current)
        for i, u in enumerate(units):
            self.gather_unit(units, i, pending, lambda v: self._start_fwd(v, current), hops)
            if self.choice.qwz_bits and not (self.choice.hpz > 1 and current):
                self.dequantize(self.chunk(u.numels) * self.hw.world, self.choice.qwz_bits)
            if i:  # the root's compute (the head) runs after the blocks
                self.run_compute(self.compute_of[u.name] * self.fwd_share)
        self.run_compute(self.compute_of[units[0].name] * self.fwd_share)

    def elements(self, u: UnitSpec) -> int:
        return sum(ShardSpec(n, (n,), self.hw.world).padded for n in u.numels)

    def admits(self, order: Sequence[UnitSpec], i: int, ahead: int = 1) -> bool:
        """Whether the engine prefetches ``order[i + ahead]`` while gathering ``order[i]`` and the units
        between (the root, gathered first, stays gathered through the pass)."""
        need = self.elements(order[i + ahead])
        live = self.elements(order[0]) if i > 0 else 0
        gathering = sum(self.elements(u) for u in order[i : i + ahead])
        bucket = self.w.prefetch_bucket if self.w.prefetch_bucket is not None else need
        max_live = self.w.max_live if self.w.max_live is not None else live + gathering + need
        return need <= bucket and live + gathering + need <= max_live

    def gather_unit(self, order: Sequence[UnitSpec], i: int, pending: dict[int, _Gather],
                    start: Callable[[UnitSpec], _Gather], hops: Callable[[UnitSpec], list[coll.Collective]]) -> None:
        """Unit ``i``'s gather as ``ZeroEngine._gather`` and ``_prefetch`` run it: its own gather unless it was
        prefetched; the next unit's; a two-hop gather's first hop (Note [two-hop gather]) for the unit after
        that, and the next unit's second hop; then the wait for unit ``i``."""
        if i not in pending:
            pending[i] = start(order[i])
        ahead = pending.get(i + 1)
        if ahead is None and i + 1 < len(order) and self.admits(order, i):
            pending[i + 1] = start(order[i + 1])
        if i + 2 < len(order) and i + 1 in pending and i + 2 not in pending and len(hops(order[i + 2])) > 1 \
                and self.admits(order, i, 2):
            pending[i + 2] = start(order[i + 2])
        if ahead is not None and ahead[1]:
            self.clock.wait(ahead[0])
            pending[i + 1] = (self.clock.issue(ahead[1]), [])
        self.finish_gather(pending[i])

    def _start_fwd(self, u: UnitSpec, current: bool) -> _Gather:
        if self.choice.qwz_bits and not (self.choice.hpz > 1 and current):
            self.quantize(self.chunk(u.numels), self.choice.qwz_bits)
        return self.start_gather(coll.forward_gather(u.numels, self.choice, self.layout, self.w.bf16, self.w.block,
                                                     current))

    def start_gather(self, hops: list[coll.Collective]) -> _Gather:
        """Issue a gather's first hop; a second one (a two-hop world gather) waits for ``gather_unit`` to
        advance it, or for ``finish_gather``."""
        return self.clock.issue(hops[:1]), hops[1:]

    def finish_gather(self, gather: _Gather) -> None:
        done, rest = gather
        self.clock.wait(done)
        if rest:
            self.clock.wait(self.clock.issue(rest))

    def backward(self) -> None:
        units = self.model.units
        order = [units[0]] + list(reversed(units[1:]))
        bwd_share = 1.0 - self.fwd_share
        buckets = _Buckets(self)
        pending: dict[int, _Gather] = {}
        for i, u in enumerate(order):
            if self.choice.stage == 3:
                self.gather_unit(order, i, pending, lambda v: self.start_gather(self._bwd_gather(v)),
                                 self._bwd_gather)
            self.run_compute(self.compute_of[u.name] * bwd_share)
            if i and self.choice.stage >= 2:
                buckets.add_unit(u)
        if self.choice.stage >= 2:
            buckets.add_unit(units[0])  # the root's gradients (embeddings) complete last
            buckets.finish()

    def _bwd_gather(self, u: UnitSpec) -> list[coll.Collective]:
        return coll.backward_gather(u.numels, self.choice, self.layout, self.w.bf16)

    def step(self) -> None:
        """The boundary: stages 0-1 reduce whole gradients; norm, optimizer; stages 1-2 gather weights."""
        if self.choice.stage < 2:
            buckets = _Buckets(self)
            for u in self.model.units:
                buckets.add_unit(u)
            buckets.finish()
        elements = self.chunk(self.model.numels)
        if self.shard_world > 1:
            self.clock.wait(self.clock.issue([coll.grad_norm(self.layout)]))
        rate = self.hw.offload_optimizer_per_s if self.choice.offload else self.hw.optimizer_per_s
        self.clock.do(elements / rate)
        if self.choice.offload and not self.hw.device_is_host:  # the updated 16-bit shard goes up
            self.clock.do(elements * self.elem / self.hw.host_link_bytes_per_s)
        if self.choice.stage < 3:
            for u in self.model.units:
                self.finish_gather(self.start_gather(coll.resident_gather(u.numels, self.layout, self.w.bf16,
                                                                          self.choice.stage)))
                self.clock.do(self.chunk(u.numels) * self.shard_world * self.elem / self.hw.copy_bytes_per_s)

    def run(self) -> StepTime:
        for micro in range(self.w.grad_accum):
            self.forward(first_micro=micro == 0)
            self.backward()
        self.step()
        c = self.clock
        cpu = c.work + c.host_comm if self.hw.comm_uses_compute else 0.0
        volumes = {p: {"intra_node_bytes": v[0], "inter_node_bytes": v[1]} for p, v in c.volumes.items()}
        return StepTime(max(c.main, cpu), c.main, cpu, self.compute, c.work - self.compute, c.comm, c.waited,
                        volumes)


@dataclass
class _Reduction:
    """A bucket's reduction in flight: when its (first) collective completes, and for qgZ whether the second
    hop has started and when it completes."""

    numels: list[int]
    first_done: float
    second_done: Optional[float] = None


class _Buckets:
    """``GradBuckets``: parameters' full gradients fill a bucket to half of ``reduce_bucket_size`` padded
    elements, cut before a gradient would overflow it (Note [bucket size]); a full bucket is packed and its
    reduction issued after completing the one in flight."""

    def __init__(self, step: _Step) -> None:
        self.s = step
        self.ready: list[int] = []
        self.size = 0
        self.inflight: Optional[_Reduction] = None

    def add_unit(self, u: UnitSpec) -> None:
        self.progress()
        capacity = bucket_capacity(self.s.w.bucket)
        for n in reversed(u.numels):  # autograd meets a block's parameters last-used first
            padded = ShardSpec(n, (n,), self.s.shard_world).padded
            if self.ready and self.size + padded > capacity:
                self.flush()
            self.ready.append(n)
            self.size += padded
            if self.size >= capacity:
                self.flush()

    def progress(self) -> None:
        """qgZ: start the in-flight bucket's second hop if its first has arrived by now."""
        job = self.inflight
        if job is not None and self.s.choice.qgz_bits and job.second_done is None \
                and job.first_done <= self.s.clock.main:
            self._second_hop(job)

    def _hops(self, numels: list[int]) -> list[coll.Collective]:
        s = self.s
        return coll.reduce(numels, s.choice, s.layout, s.w.bf16, s.w.block, s.w.ring_reduce_scatter)

    def flush(self) -> None:
        if not self.ready:
            return
        numels, self.ready, self.size = self.ready, [], 0
        s, clock = self.s, self.s.clock
        padded = s.chunk(numels) * s.shard_world
        clock.do(padded * s.elem / s.hw.copy_bytes_per_s)  # pack the bucket
        hops = self._hops(numels)
        if s.choice.qgz_bits:
            s.quantize(padded, s.choice.qgz_bits)
            first = clock.issue(hops[:1])
        else:
            first = clock.issue(hops)
        if self.inflight is not None:
            self._complete(self.inflight)
        self.inflight = _Reduction(numels, first)

    def _second_hop(self, job: _Reduction) -> None:
        """qgZ steps 3-4: dequantize the node's pieces, sum, requantize, issue the inter-node hop."""
        s, clock = self.s, self.s.clock
        clock.wait(job.first_done)
        padded = s.chunk(job.numels) * s.shard_world
        bits, n = s.choice.qgz_bits, s.layout.num_nodes
        hops = self._hops(job.numels)
        if s.layout.ranks_per_node > 1:  # D senders x n rows in, n rows out
            fused = s.hw.qgz_sum_requantize_per_s.get(bits)
            if fused:
                clock.do(padded / fused)
            else:
                s.dequantize(padded, bits)
                clock.do(padded / s.hw.reduce_sum_per_s)
                if n > 1:
                    s.quantize(padded // s.layout.ranks_per_node, bits)
        job.second_done = clock.issue(hops[1:]) if n > 1 and len(hops) > 1 else clock.main

    def _complete(self, job: _Reduction) -> None:
        s, clock = self.s, self.s.clock
        padded = s.chunk(job.numels) * s.shard_world
        row = padded // s.shard_world
        if s.choice.qgz_bits:
            if job.second_done is None:
                self._second_hop(job)
            assert job.second_done is not None
            clock.wait(job.second_done)
            if s.layout.num_nodes > 1:
                fused = s.hw.qgz_sum_per_s.get(s.choice.qgz_bits)
                if fused:
                    clock.do(s.layout.num_nodes * row / fused)
                else:
                    s.dequantize(s.layout.num_nodes * row, s.choice.qgz_bits)
                    clock.do(s.layout.num_nodes * row / s.hw.reduce_sum_per_s)
        else:
            clock.wait(job.first_done)
            if s.shard_world > 1 and not s.w.ring_reduce_scatter:
                clock.do(padded / s.hw.reduce_sum_per_s)  # fp32 sum of the W received rows
        clock.do(row * s.elem / s.hw.copy_bytes_per_s)  # add into the gradient rows
        if s.choice.offload and not s.hw.device_is_host:
            clock.do(row * s.elem / s.hw.host_link_bytes_per_s)

    def finish(self) -> None:
        self.flush()
        if self.inflight is not None:
            self._complete(self.inflight)
            self.inflight = None


def step_time(model: ModelSpec, choice: Choice, hw: Hardware, work: Workload) -> StepTime:
    """Predicted time of one optimizer step (``work.grad_accum`` micro-steps) of ``choice`` on ``hw``."""
    return _Step(model, choice, hw, work).run()
