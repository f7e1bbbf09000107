"""No allocation on the ZeRO++ hot path (Note [buffer pool] in comm/buffers.py), and qgZ's overlapped second
hop (Note [overlapped second hop] in plus/qgz.py), on 2 simulated nodes x 2 ranks.

Every call into the engine's strategies (qwZ forward gather, hpZ backward gather, qgZ reduction) runs
under a dispatch mode that counts the tensors torch creates with storage of their own; the tensors the
strategies hand to the engine are kept alive by the test, so a strategy that allocated them afresh could
not get the same address back from the allocator.

Step 1 learns the order of the units, step 2 is the first to prefetch (one more gather in flight), so the
pools reach their size in step 2; the later steps must allocate nothing and hand out the same buffers.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zeropp
from support.models import rank_slice
from support.qgz_case import BLOCK, SEGMENTS, bucket_for
from support.world import run_world
from zeropp import topology
from zeropp.comm.ledger import CommLedger, Phase
from zeropp.comm.ops import Comm
from zeropp.plus.qgz import QuantizedReduce
from zeropp.plus.wire import pack, quantize_poisoning, unpack
from zeropp.quant import BlockLayout, dequantize, payload_bytes

STEPS = 4
WARM = 2  # steps after which nothing may grow
BIG = 256  # bytes: an allocation at least this large counts (a few-byte scalar from a finiteness check does not)
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


class Stack(nn.Module):
    """An embedding, ``depth`` residual MLP blocks of three different widths (one gather unit each), a head."""

    def __init__(self, depth: int, dim: int = 32, vocab: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        widths = (32, 48, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, widths[i % 3]), nn.GELU(), nn.Linear(widths[i % 3], dim))
            for i in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), targets.flatten())


class Recorder:
    """What the strategies did, per step: big allocations, the tensors they handed out, early second hops."""

    def __init__(self) -> None:
        self.step = 0
        self.allocs: list[tuple[int, str, int]] = []
        self.handed: list[tuple[int, torch.Tensor]] = []  # kept alive on purpose
        self.early_hop2 = [0] * (STEPS + 1)


class _CountAllocations(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                if t.untyped_storage().nbytes() >= BIG:
                    self.rec.allocs.append((self.rec.step, str(func), t.untyped_storage().nbytes()))
        return out


class _Watched:
    """Runs every method of a strategy or pending object under the allocation counter."""

    def __init__(self, inner: Any, rec: Recorder) -> None:
        self.inner, self.rec = inner, rec
        self.keeps_copies = getattr(inner, "keeps_copies", False)

    def _call(self, name: str, *args: Any) -> Any:
        with _CountAllocations(self.rec):
            return getattr(self.inner, name)(*args)

    def on_release(self, unit: Any) -> None:
        self._call("on_release", unit)

    def check_deferred(self) -> None:
        self._call("check_deferred")

    def held_tensors(self) -> list:
        return self.inner.held_tensors()

    def buffer_bytes(self) -> dict:
        return self.inner.buffer_bytes()

    def start(self, *args: Any) -> "_WatchedPending":
        return _WatchedPending(self._call("start", *args), self.rec)

    def two_hop(self, unit: Any) -> bool:
        return self.inner.two_hop(unit)

    def end_step(self, grad_scale: float = 1.0) -> None:
        self.inner.end_step(grad_scale)


class _WatchedPending(_Watched):
    force_hop1 = False  # qgZ: wait for hop 1 inside start, so the next gradient's progress() must see it

    def __init__(self, inner: Any, rec: Recorder) -> None:
        super().__init__(inner, rec)
        if self.force_hop1 and getattr(inner, "hop1", None) is not None:
            inner.hop1.handle.wait()

    def finish(self) -> Any:
        if getattr(self.inner, "hop1", 0) is None and getattr(self.inner, "hop2", None) is not None:
            self.rec.early_hop2[self.rec.step] += 1  # hop 2 already in flight before the bucket was finished
        out = self._call("finish")
        self.rec.handed.append((self.rec.step, out[0] if isinstance(out, tuple) else out))
        return out

    def progress(self) -> None:
        self._call("progress")

    def advance(self) -> None:
        self._call("advance")

    def recycle(self) -> None:
        self._call("recycle")


def _pools(engine: Any) -> list:
    """The buffer pools of the engine's strategies (hpZ's primary included) and of its gradient buckets."""
    found, todo = [], [engine.strategies.forward_gather, engine.strategies.backward_gather, engine.strategies.reduce]
    while todo:
        s = todo.pop()
        s = getattr(s, "inner", s)
        if hasattr(s, "pools") and all(s.pools is not f for f in found):
            found.append(s.pools)
        if hasattr(s, "primary"):
            todo.append(s.primary)
    return found


class _BucketPool:
    """The gradient buckets' single pool, with the BufferPools interface."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def allocations(self) -> int:
        return self.pool.allocations

    def leased(self) -> int:
        return self.pool.leased()


def run_engine(rank: int, world: int, depth: int, force_hop1: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, **ZEROPP}}
    engine, *_ = zeropp.initialize(model=Stack(depth), config=cfg)
    rec = Recorder()
    s = engine.strategies
    engine.strategies = type(s)(_Watched(s.forward_gather, rec), _Watched(s.backward_gather, rec),
                                _Watched(s.reduce, rec))
    _WatchedPending.force_hop1 = force_hop1
    pools = _pools(engine) + [_BucketPool(engine.buckets.pool)]
    out: dict[str, Any] = {"units": len(engine.units), "losses": [], "slabs": [], "bytes": [], "leased": []}
    try:
        for step in range(1, STEPS + 1):
            rec.step = step
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 24, (8, 6), generator=g)
            loss = engine(rank_slice(idx, rank, world), rank_slice(idx.roll(1, 1), rank, world))
            engine.backward(loss)
            engine.step()
            out["losses"].append(float(loss.detach()))
            out["slabs"].append(sum(p.allocations() for p in pools))
            out["bytes"].append({k: v for st in (s.forward_gather, s.backward_gather, s.reduce)
                                 for k, v in st.buffer_bytes().items()})
            out["leased"].append(sum(p.leased() for p in pools))
    finally:
        _WatchedPending.force_hop1 = False
    out["allocs"] = rec.allocs
    out["ptrs"] = [sorted({t.data_ptr() for st, t in rec.handed if st <= k}) for k in range(1, STEPS + 1)]
    out["handed_per_step"] = [sum(1 for st, _ in rec.handed if st == k) for k in range(1, STEPS + 1)]
    out["early_hop2"] = rec.early_hop2[1:]
    return out


def qgz_against_allocating_reference(rank: int, world: int) -> dict:
    """The pooled qgZ against the algorithm as it was before pools (pack/unpack, allocating), bit for bit,
    with hop 2 started by progress() and without; twice, so the second round runs on reused buffers."""
    topo = topology.build(ranks_per_node=2)
    comm = Comm(topo, CommLedger())
    d, n = topo.ranks_per_node, topo.num_nodes
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (4, 8):
            layout = BlockLayout(SEGMENTS, BLOCK)
            pb = payload_bytes(layout, bits)

            def hop(rows: torch.Tensor, group: Any) -> torch.Tensor:
                wire = pack(quantize_poisoning(rows, layout, bits))
                got = torch.empty_like(wire)
                comm.all_to_all(got, wire, group, Phase.GRAD_REDUCE)
                return dequantize(unpack(got, pb), layout, bits, torch.float32)

            bucket = bucket_for(rank, world, dtype)
            bucket[rank % 2, 3] = float("nan") if bits == 8 else bucket[rank % 2, 3]  # poisoning, too
            rows = bucket.view(n, d, -1).transpose(0, 1).reshape(d * n, -1)
            partial = hop(rows, topo.intra_node).view(d, n, -1).sum(dim=0)
            want = hop(partial, topo.inter_node).sum(dim=0).div_(world)
            reduce = QuantizedReduce(comm, bits, BLOCK)
            same = []
            for early in (False, True, False, True):
                pending = reduce.start(bucket, SEGMENTS)
                if early:
                    pending.hop1.handle.wait()
                    pending.progress()
                    assert pending.hop1 is None and pending.hop2 is not None
                got = pending.finish()
                same.append(torch.equal(got.view(torch.int32), want.view(torch.int32)))
                pending.recycle()
            out[(dtype, bits)] = {"same": same, "slabs": reduce.pools.allocations()}
    return out


def hot_path_results(rank: int, world: int) -> dict:
    return {
        "small": run_engine(rank, world, depth=3),
        "large": run_engine(rank, world, depth=9),
        "forced": run_engine(rank, world, depth=3, force_hop1=True),
        "qgz": qgz_against_allocating_reference(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list:
    return run_world(hot_path_results, 4, ranks_per_node=2)


@pytest.mark.parametrize("case", ["small", "large"])
def test_no_big_allocation_in_the_strategies_after_warm_up(results: list, case: str) -> None:
    for rank, res in enumerate(results):
        later = [a for a in res[case]["allocs"] if a[0] > WARM]
        assert not later, f"rank {rank}: the strategies allocated after step {WARM}: {later[:5]}"
        assert any(a[0] == 1 for a in res[case]["allocs"]), "the counter saw nothing (would prove nothing)"


@pytest.mark.parametrize("case", ["small", "large"])
def test_handed_out_buffers_are_a_few_reused_ones(results: list, case: str) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        assert r["ptrs"][WARM - 1] == r["ptrs"][-1], f"rank {rank}: new buffers after step {WARM}"
        assert min(r["handed_per_step"]) > 2 * r["units"], "each step hands out rows for every unit"
        assert len(r["ptrs"][-1]) <= 12, f"rank {rank}: {len(r['ptrs'][-1])} buffers for {r['units']} units"
        assert r["slabs"][WARM - 1] == r["slabs"][-1], f"rank {rank}: pools grew after step {WARM}: {r['slabs']}"
        assert r["bytes"][WARM - 1] == r["bytes"][-1]
        assert r["leased"] == [0] * STEPS, f"rank {rank}: buffers still lent out between steps: {r['leased']}"


def test_pool_does_not_grow_with_the_number_of_units(results: list) -> None:
    for res in results:
        small, large = res["small"], res["large"]
        assert large["units"] >= 2 * small["units"]
        assert len(large["ptrs"][-1]) == len(small["ptrs"][-1])
        assert large["bytes"][-1] == small["bytes"][-1]
        names = set(large["bytes"][-1])
        assert {"qwz_send", "qwz_recv", "qwz_out", "hpz_out", "qgz_send", "qgz_recv", "qgz_scales",
                "qgz_result"} <= names


def test_second_hop_starts_before_the_bucket_is_finished(results: list) -> None:
    for rank, res in enumerate(results):
        forced, plain = res["forced"], res["small"]
        assert all(n >= 1 for n in forced["early_hop2"]), f"rank {rank}: {forced['early_hop2']}"
        assert forced["losses"] == plain["losses"]  # when hop 2 starts changes no value
        assert not [a for a in forced["allocs"] if a[0] > WARM]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_pooled_qgz_is_bit_identical_to_the_allocating_algorithm(results: list, dtype: torch.dtype,
                                                                 bits: int) -> None:
    for rank, res in enumerate(results):
        case = res["qgz"][(dtype, bits)]
        assert case["same"] == [True] * 4, f"rank {rank}: {case['same']}"
        assert case["slabs"] <= 8  # four rounds on the same few buffers
