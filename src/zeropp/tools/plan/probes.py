"""Measurements taken inside one rank while every rank runs the same probe at once (so a shared host's
contention is part of what is measured): compute, quantizer, host work, and collectives over each group.

Collectives go through :class:`zeropp.comm.ops.Comm` like the engine's, on the groups ``topology.build`` makes;
each timing is the slowest rank's, the median of a few repetitions. Every probe returns plain numbers.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from zeropp.comm.ledger import CommLedger, Phase
from zeropp.comm.ops import Comm
from zeropp.topology import Group, Topology

#: The probe model: the bench GPT (``zeropp bench``'s), micro-batch 2 x 64 tokens, bf16.
PROBE_GPT = {"n_layer": 4, "n_embd": 640, "n_head": 10, "block_size": 64}
PROBE_MICRO_BATCH = 2
#: Row sizes (bytes per rank) for the two-point alpha-beta fits.
SMALL_ROW, LARGE_ROW = 64 * 1024, 4 * 1024 * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn: Callable[[], None], work: float, device: torch.device, min_s: float = 0.4, reps: int = 5) -> float:
    """``work`` per second of ``fn``: the median of ``reps`` timings after one warm-up call, each repeated until
    it lasts ``min_s``."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, int(min_s / reps / once))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return work / statistics.median(samples)


# ---- compute ---------------------------------------------------------------------------------------------
def matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of the probe GPT's largest matmul shape (tokens x width @ width x 4 width)."""
    tokens, width = PROBE_MICRO_BATCH * PROBE_GPT["block_size"], PROBE_GPT["n_embd"]
    a = torch.randn(tokens, width, device=device, dtype=dtype)
    b = torch.randn(width, 4 * width, device=device, dtype=dtype)
    return rate(lambda: torch.mm(a, b), 2.0 * tokens * width * 4 * width, device)


def step_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """``6 * params * tokens`` per second of the probe GPT's forward + backward (weights in ``dtype``)."""
    from zeropp.tools.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**PROBE_GPT)).to(device=device, dtype=dtype)
    tokens = PROBE_MICRO_BATCH * PROBE_GPT["block_size"]
    x = torch.randint(0, 256, (PROBE_MICRO_BATCH, PROBE_GPT["block_size"]), device=device)

    def step() -> None:
        model(x, x).backward()
        for p in model.parameters():
            p.grad = None

    return rate(step, 6.0 * model.num_parameters() * tokens, device, min_s=1.0, reps=3)


# ---- quantizer and host work ------------------------------------------------------------------------------
def quantizer_rates(device: torch.device, bits: int, block: int = 2048) -> tuple[float, float]:
    """Elements per second of (quantize + pack one row, unpack + dequantize four rows), as qwZ/qgZ run them."""
    from zeropp.plus.wire import pack, quantize_poisoning, unpack
    from zeropp.quant import BlockLayout, dequantize, payload_bytes

    n = LARGE_ROW // 2
    layout = BlockLayout((n,), block)
    row = torch.randn(1, n, device=device, dtype=torch.bfloat16)
    wire = pack(quantize_poisoning(row, layout, bits))
    rows = wire.expand(4, -1).contiguous()
    payload = payload_bytes(layout, bits)
    q = rate(lambda: pack(quantize_poisoning(row, layout, bits)), n, device)
    d = rate(lambda: dequantize(unpack(rows, payload), layout, bits, torch.bfloat16), 4 * n, device)
    return q, d


def qgz_fused_rates(device: torch.device, bits: int, block: int = 2048) -> tuple[float, float]:
    """Input elements per second of qgZ's fused steps (``plus/qgz.py``): step 3 (dequantize 2 pieces, sum,
    requantize) and step 5 (dequantize 4 pieces, sum, divide), on four quantized rows."""
    from zeropp.quant import BlockLayout, dequantize_sum, dequantize_sum_quantize, quantize

    n = LARGE_ROW // 2
    layout = BlockLayout((n,), block)
    q = quantize(torch.randn(4, n, device=device, dtype=torch.bfloat16), layout, bits)
    step3 = rate(lambda: dequantize_sum_quantize(q, layout, bits, 2), 4.0 * n, device)
    step5 = rate(lambda: dequantize_sum(q, layout, bits, 4, divisor=4.0), 4.0 * n, device)
    return step3, step5


def optimizer_rate(device: torch.device) -> float:
    """Master elements per second through what ``engine.step()`` does per unit at stage 3: the gradient row to
    fp32, its fp64 norm, the clip, AdamW (torch's default implementation) and the recast of the 16-bit shard."""
    shapes = [1_228_800, 1920, 409_600, 640, 1_638_400, 2560, 1_638_400, 640]  # a bench block's matrices, biases
    n = sum(shapes)
    masters = [torch.zeros(s, device=device) for s in shapes]
    for m in masters:
        m.normal_()
    opt = torch.optim.AdamW(masters, lr=1e-4)
    grad16 = torch.randn(n, device=device, dtype=torch.bfloat16) * 1e-3
    shard16 = torch.empty(n, device=device, dtype=torch.bfloat16)

    def step() -> None:
        g = grad16.to(torch.float32)
        norm = torch.linalg.vector_norm(g, dtype=torch.float64)
        g.mul_(float(1.0 / (1.0 + norm.item())))
        off = 0
        for m in masters:
            m.grad = g[off : off + m.numel()]
            off += m.numel()
        opt.step()
        off = 0
        for m in masters:  # the recast, per master as ``Unit.refresh_shard_from_master`` writes it
            shard16[off : off + m.numel()].copy_(m.detach().reshape(-1))
            off += m.numel()

    return rate(step, float(n), device, min_s=1.0, reps=3)


def reduce_sum_rate(device: torch.device, world: int = 4) -> float:
    """Received elements per second of the plain reduce-scatter's fp32 sum and mean, as ``comm/reduce.py`` runs
    it: the 16-bit rows copied into a pooled fp32 buffer, summed into a pooled row, divided. (A fresh ``.float()``
    per call, as this probe once did, timed page faults the engine's pools never take: 3.4x slower here.)"""
    received = torch.randn(world, LARGE_ROW // 2, device=device, dtype=torch.bfloat16)
    wide = torch.empty(received.shape, device=device, dtype=torch.float32)
    result = torch.empty(received.shape[1], device=device, dtype=torch.float32)

    def run() -> None:
        wide.copy_(received)
        torch.sum(wide, dim=0, out=result).div_(world)

    return rate(run, float(received.numel()), device)


def copy_rate(device: torch.device) -> float:
    """Bytes per second of packing 16-bit gradients into a bucket (``torch.cat``)."""
    parts = [torch.randn(4, LARGE_ROW // 16, device=device, dtype=torch.bfloat16) for _ in range(4)]
    return rate(lambda: torch.cat(parts, dim=1), float(sum(p.numel() * 2 for p in parts)), device)


# ---- collectives ------------------------------------------------------------------------------------------
def slowest(comm: Comm, seconds: float) -> float:
    """The largest ``seconds`` over all ranks."""
    t = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(t, comm.topo.world, Phase.OTHER, op="max")
    return float(t.item())


def time_collective(comm: Comm, run: Callable[[], None], reps: int) -> float:
    """The slowest rank's seconds for ``run`` (a synchronous collective), median of ``reps`` after a warm-up."""
    samples = []
    for i in range(reps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        run()
        elapsed = time.perf_counter() - t0
        if i:
            samples.append(slowest(comm, elapsed))
    return statistics.median(samples)


def _received(comm: Comm, before: int) -> int:
    led = comm.ledger.current_report()
    return sum(v["intra_node_bytes"] + v["inter_node_bytes"] for v in led.values()) - before


def _ledger_total(comm: Comm) -> int:
    led = comm.ledger.current_report()
    return sum(v["intra_node_bytes"] + v["inter_node_bytes"] for v in led.values())


def collective_points(comm: Comm, pattern: str, group: Group, reps: int = 3,
                      device: torch.device = torch.device("cpu")) -> list[tuple[int, float]]:
    """``(received bytes per rank, seconds)`` at a small and a large row for ``pattern`` over ``group``, with
    tensors on ``device`` (as the engine's would be)."""
    points = []
    for row_bytes in (SMALL_ROW, LARGE_ROW):
        n = row_bytes // 2
        if pattern == "all_gather":
            inp = torch.zeros(n, dtype=torch.bfloat16, device=device)
            out = torch.empty(group.size * n, dtype=torch.bfloat16, device=device)
            run = lambda: comm.all_gather(out, inp, group, Phase.OTHER)  # noqa: E731
        elif pattern == "all_to_all":
            inp = torch.zeros(group.size * n, dtype=torch.bfloat16, device=device)
            out = torch.empty_like(inp)
            run = lambda: comm.all_to_all(out, inp, group, Phase.OTHER)  # noqa: E731
        elif pattern == "all_reduce":
            # small: the global norm's few fp64 values (latency); large: a 16-bit row
            t = torch.zeros(1, dtype=torch.float64, device=device) if row_bytes == SMALL_ROW \
                else torch.zeros(n, dtype=torch.bfloat16, device=device)
            run = lambda: comm.all_reduce(t, group, Phase.OTHER)  # noqa: E731
        else:
            raise ValueError(f"unknown pattern {pattern!r}")
        before = _ledger_total(comm)
        run()  # counts the bytes one call receives (the warm-up inside time_collective repeats it)
        received = _received(comm, before)
        points.append((received, time_collective(comm, lambda: (run(), _sync(device)), reps)))
    return points


def fit_points(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(alpha_s, bytes_per_s)`` through two ``(bytes, seconds)`` points (alpha clamped at 0)."""
    (b0, t0), (b1, t1) = points
    slope = max((t1 - t0) / (b1 - b0), 1e-15) if b1 != b0 else t1 / max(b1, 1)
    alpha = max(0.0, t0 - b0 * slope)
    return alpha, 1.0 / slope


def new_comm(topo: Topology) -> Comm:
    return Comm(topo, CommLedger())
