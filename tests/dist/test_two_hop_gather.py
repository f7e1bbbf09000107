"""Note [two-hop gather] in ``comm/gather.py``: a gather over the world on several nodes of several ranks runs as
an inter-node all-gather among the ranks of one local index, then an intra-node one.

On 3 nodes x 2 ranks and 2 nodes x 3 ranks: the rows equal a one-hop all-gather over the world bit for bit (16-bit
and wire bytes), in rank order; the ledger counts ``n - 1`` rows from other nodes and ``(D - 1) n`` from the node;
ZeRO-3 and ZeRO++ train bit-identically with and without the second hop's route, while the route sends fewer
inter-node bytes; qgZ's early second hop runs on a communicator of its own.
"""
from __future__ import annotations

import functools

import pytest
import torch

import zeropp
from support.world import run_world
from zeropp import accounting
from zeropp.comm.buffers import BufferPool
from zeropp.comm.gather import WorldRoute
from zeropp.comm.ledger import CommLedger, Phase
from zeropp.comm.ops import Comm
from zeropp.tools.demo.model import GPT, GPTConfig
from zeropp.topology import build

ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": None, "zero_quantized_gradients": True}


def _routes(rank: int, world: int, per_node: int) -> dict:
    topo = build(per_node)
    comm = Comm(topo, CommLedger())
    route, flat = WorldRoute(comm), WorldRoute(comm)
    flat.two_hop = False
    out: dict = {"two_hop": route.two_hop, "early_is_own": topo.inter_node_early is not topo.inter_node,
                 "early_ranks": topo.inter_node_early.ranks == topo.inter_node.ranks}
    for dtype, numel in ((torch.bfloat16, 1001), (torch.uint8, 77)):
        row = (torch.arange(numel) * (rank + 1) % 251).to(dtype)
        a = route.start(row, BufferPool(), BufferPool(), Phase.FORWARD_GATHER)
        got = a.ranked(a.wait()).reshape(world, numel).clone()
        before = comm.ledger.current_report()["forward_gather"]
        b = flat.start(row, BufferPool(), BufferPool(), Phase.BACKWARD_GATHER)
        want = b.ranked(b.wait()).clone()
        out[str(dtype)] = {"equal": torch.equal(got, want), "rows": [int(got[r, 1]) for r in range(world)],
                           "bytes": numel * row.element_size()}
        out[str(dtype)]["two_hop_ledger"] = dict(before)
        comm.ledger.reset()
    return out


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _train(rank: int, world: int, per_node: int, zero: dict, flat: bool) -> dict:
    init = WorldRoute.__init__
    if flat:  # the one-hop route everywhere
        def one_hop(self, comm, group=None):  # type: ignore[no-untyped-def]
            init(self, comm, group)
            self.two_hop = False
        WorldRoute.__init__ = one_hop  # type: ignore[method-assign]
    try:
        zero = {k: (per_node if v is None else v) for k, v in zero.items()}
        engine = zeropp.initialize(model=_model(0), config={
            "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, **zero}, "topology": {"ranks_per_node": per_node}})[0]
    finally:
        WorldRoute.__init__ = init  # type: ignore[method-assign]
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 64, (2, 16), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.consolidated_state_dict()
    return {"losses": losses, "state": state, "comm": engine.comm_report()}


def measure(rank: int, world: int, per_node: int) -> dict:
    out = {"routes": _routes(rank, world, per_node)}
    for name, zero in (("zero3", {}), ("zeropp", ZEROPP)):
        out[name] = {"two_hop": _train(rank, world, per_node, zero, flat=False),
                     "flat": _train(rank, world, per_node, zero, flat=True)}
    return out


@functools.lru_cache(maxsize=None)
def results(world: int, per_node: int) -> list[dict]:
    return run_world(measure, world, per_node, ranks_per_node=per_node)


@pytest.fixture(scope="module", params=[(6, 2), (6, 3)], ids=["3x2", "2x3"])
def runs(request: pytest.FixtureRequest) -> tuple[int, int, list[dict]]:
    world, per_node = request.param
    return world, per_node, results(world, per_node)


def test_rows_equal_a_one_hop_gather_in_rank_order(runs: tuple[int, int, list[dict]]) -> None:
    world, _, res = runs
    for r in res:
        assert r["routes"]["two_hop"]
        for dtype in ("torch.bfloat16", "torch.uint8"):
            assert r["routes"][dtype]["equal"], dtype
            assert r["routes"][dtype]["rows"] == [(src + 1) % 251 for src in range(world)]


def test_ledger_counts_a_row_per_other_node_across_the_link(runs: tuple[int, int, list[dict]]) -> None:
    world, d, res = runs
    n = world // d
    for r in res:
        for dtype in ("torch.bfloat16", "torch.uint8"):
            row = r["routes"][dtype]["bytes"]
            assert r["routes"][dtype]["two_hop_ledger"] == {"intra_node_bytes": (d - 1) * n * row,
                                                            "inter_node_bytes": (n - 1) * row}
            assert accounting.world_gather_volume(row, zeropp.topology.Layout(world, d), 0).as_dict() == \
                r["routes"][dtype]["two_hop_ledger"]


def test_qgz_early_hop_has_its_own_communicator(runs: tuple[int, int, list[dict]]) -> None:
    for r in runs[2]:
        assert r["routes"]["early_is_own"] and r["routes"]["early_ranks"]


def test_training_is_bit_identical_and_crosses_the_link_less(runs: tuple[int, int, list[dict]]) -> None:
    world, d, res = runs
    for r in res:
        for name in ("zero3", "zeropp"):
            two, flat = r[name]["two_hop"], r[name]["flat"]
            assert two["losses"] == flat["losses"], name
            assert two["state"].keys() == flat["state"].keys()
            assert all(torch.equal(two["state"][k], flat["state"][k]) for k in two["state"]), name
            fwd_two, fwd_flat = two["comm"]["forward_gather"], flat["comm"]["forward_gather"]
            # per rank: n - 1 rows from other nodes instead of W - D
            n = world // d
            assert fwd_two["inter_node_bytes"] * (world - d) == fwd_flat["inter_node_bytes"] * (n - 1), name
            assert two["comm"]["grad_reduce"] == flat["comm"]["grad_reduce"]
