"""Topology: node-major rank arithmetic, the error messages for impossible layouts, and ``build``'s group
creation (every rank creates every group in the same order) exercised with a fake ``new_group``."""
from __future__ import annotations

import itertools

import pytest

from zeropp import topology
from zeropp.topology import Group, Layout, TopologyError

# (nodes, ranks_per_node)
SHAPES = [(2, 2), (3, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("nodes,d", SHAPES)
def test_layout_arithmetic(nodes: int, d: int) -> None:
    w = nodes * d
    lay = Layout(w, d)
    assert lay.num_nodes == nodes
    seen = set()
    for r in range(w):
        node, local = lay.node_of(r), lay.local_of(r)
        assert 0 <= node < nodes and 0 <= local < d
        assert node * d + local == r  # node-major, as torchrun starts ranks
        seen.add((node, local))
    assert len(seen) == w  # (node, local) is a bijection


@pytest.mark.parametrize("nodes,d", SHAPES)
def test_intra_inter_rank_sets(nodes: int, d: int) -> None:
    w = nodes * d
    lay = Layout(w, d)
    intra = [lay.intra_node_ranks(n) for n in range(nodes)]
    inter = [lay.inter_node_ranks(j) for j in range(d)]
    # each family partitions the world
    assert sorted(itertools.chain(*intra)) == list(range(w))
    assert sorted(itertools.chain(*inter)) == list(range(w))
    for n, ranks in enumerate(intra):
        assert len(ranks) == d and all(lay.node_of(r) == n for r in ranks)
    for j, ranks in enumerate(inter):
        assert len(ranks) == nodes
        assert [lay.node_of(r) for r in ranks] == list(range(nodes))  # one per node, in node order
        assert all(lay.local_of(r) == j for r in ranks)
    # an intra group and an inter group meet in exactly one rank
    for a in intra:
        for b in inter:
            assert len(set(a) & set(b)) == 1


def test_explicit_rank_sets_3x2() -> None:
    lay = Layout(6, 2)
    assert [lay.intra_node_ranks(n) for n in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert [lay.inter_node_ranks(j) for j in range(2)] == [(0, 2, 4), (1, 3, 5)]
    assert [lay.hpz_ranks(g, 3) for g in range(2)] == [(0, 1, 2), (3, 4, 5)]
    assert [lay.hpz_ranks(g, 2) for g in range(3)] == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize("w,s", [(4, 1), (4, 2), (4, 4), (6, 3), (6, 2), (8, 4)])
def test_hpz_rank_sets_tile_world(w: int, s: int) -> None:
    lay = Layout(w, 1)
    lay.check_hpz(s)
    groups = [lay.hpz_ranks(g, s) for g in range(w // s)]
    assert list(itertools.chain(*groups)) == list(range(w))
    assert all(len(g) == s and list(g) == list(range(g[0], g[0] + s)) for g in groups)


@pytest.mark.parametrize("w,d", [(4, 3), (6, 4), (3, 2), (5, 0), (4, 8)])
def test_ranks_per_node_not_dividing_world(w: int, d: int) -> None:
    with pytest.raises(TopologyError) as err:
        Layout(w, d)
    msg = str(err.value)
    assert "topology.ranks_per_node" in msg
    assert str(d) in msg and str(w) in msg


def test_world_size_zero_rejected() -> None:
    with pytest.raises(TopologyError, match="world size"):
        Layout(0, 1)


@pytest.mark.parametrize("w,s", [(4, 3), (6, 4), (4, 0), (2, 4)])
def test_hpz_not_dividing_world(w: int, s: int) -> None:
    with pytest.raises(TopologyError) as err:
        Layout(w, 1).check_hpz(s)
    msg = str(err.value)
    assert "zero_optimization.zero_hpz_partition_size" in msg
    assert str(s) in msg and str(w) in msg


def test_topology_error_is_value_error() -> None:
    assert issubclass(TopologyError, ValueError)


def test_group_size_and_index() -> None:
    g = Group((1, 3, 5))
    assert g.size == 3
    assert g.index_of(5) == 2 and g.index_of(1) == 0
    with pytest.raises(ValueError):
        g.index_of(2)
    assert Group((1, 3), handle="a") == Group((1, 3), handle="b")  # the handle is not part of identity


# ---------------------------------------------------------------------------------------------- build()
class Recorder:
    """A fake ``new_group``: records the rank lists in call order and returns a unique handle each."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, ranks: list[int]) -> str:
        assert isinstance(ranks, list)
        self.calls.append(tuple(ranks))
        return f"h{len(self.calls) - 1}:{tuple(ranks)}"


def _build_as(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, d: int | None, s: int = 1):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    rec = Recorder()
    topo = topology.build(ranks_per_node=d, hpz_partition_size=s, new_group=rec)
    return topo, rec


def _expected_calls(w: int, d: int, s: int) -> list[tuple[int, ...]]:
    lay = Layout(w, d)
    calls = [lay.intra_node_ranks(n) for n in range(w // d)]
    calls += [lay.inter_node_ranks(j) for j in range(d)]
    if s not in (d, w):
        calls += [lay.hpz_ranks(g, s) for g in range(w // s)]
    if w // d > 1 and d > 1:  # the inter-node ranks' second communicator (qgZ's early hop)
        calls += [lay.inter_node_ranks(j) for j in range(d)]
    return calls


@pytest.mark.parametrize("w,d,s", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (6, 2, 3), (6, 3, 2), (4, 1, 2),
                                   (4, 4, 1), (8, 4, 2)])
def test_build_same_groups_same_order_on_every_rank(monkeypatch: pytest.MonkeyPatch, w: int, d: int, s: int) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    calls_per_rank = []
    for rank in range(w):
        topo, rec = _build_as(monkeypatch, rank, w, d, s)
        calls_per_rank.append(rec.calls)
        lay = topo.layout
        nodes = w // d

        def handle(index: int) -> str:  # what the fake new_group returned for its index-th call
            return f"h{index}:{rec.calls[index]}"

        assert topo.rank == rank and topo.world_size == w and topo.ranks_per_node == d
        assert topo.node == rank // d and topo.local_rank == rank % d
        assert topo.world.ranks == tuple(range(w))
        # this rank's groups, with the handle new_group returned for exactly that rank set
        assert topo.intra_node.ranks == lay.intra_node_ranks(rank // d)
        assert topo.intra_node.handle == handle(rank // d)
        assert topo.inter_node.ranks == lay.inter_node_ranks(rank % d)
        assert topo.inter_node.handle == handle(nodes + rank % d)
        assert topo.hpz.ranks == lay.hpz_ranks(rank // s, s)
        assert rank in topo.hpz.ranks
        if s == d:
            assert topo.hpz is topo.intra_node  # reused, no extra group
        elif s == w:
            assert topo.hpz is topo.world
        else:
            assert topo.hpz.handle == handle(nodes + d + rank // s)
        if nodes > 1 and d > 1:
            hpz_groups = 0 if s in (d, w) else w // s
            assert topo.inter_node_early.ranks == topo.inter_node.ranks
            assert topo.inter_node_early.handle == handle(nodes + d + hpz_groups + rank % d)
        else:
            assert topo.inter_node_early is topo.inter_node
    assert all(c == calls_per_rank[0] for c in calls_per_rank)
    assert calls_per_rank[0] == _expected_calls(w, d, s)


def test_build_hpz_equal_to_node_creates_no_extra_group(monkeypatch: pytest.MonkeyPatch) -> None:
    _, rec_reuse = _build_as(monkeypatch, 1, 4, 2, 2)
    _, rec_own = _build_as(monkeypatch, 1, 4, 2, 1)
    assert len(rec_reuse.calls) == 2 + 2 + 2  # intra x2, inter x2, inter (early) x2
    assert len(rec_own.calls) == 2 + 2 + 4 + 2  # plus four singleton hpZ groups


def test_build_same_node(monkeypatch: pytest.MonkeyPatch) -> None:
    topo, _ = _build_as(monkeypatch, 3, 6, 3)
    assert topo.num_nodes == 2 and topo.node == 1 and topo.local_rank == 0
    assert [topo.same_node(r) for r in range(6)] == [False, False, False, True, True, True]


def test_build_default_ranks_per_node_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    topo, _ = _build_as(monkeypatch, 0, 4, None)
    assert topo.ranks_per_node == 2 and topo.num_nodes == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    topo, _ = _build_as(monkeypatch, 0, 4, None)
    assert topo.ranks_per_node == 4 and topo.num_nodes == 1  # unset: every rank on one node


def test_build_errors_before_creating_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rec = Recorder()
    with pytest.raises(TopologyError, match="topology.ranks_per_node"):
        topology.build(ranks_per_node=3, new_group=rec)
    with pytest.raises(TopologyError, match="zero_optimization.zero_hpz_partition_size"):
        topology.build(ranks_per_node=2, hpz_partition_size=3, new_group=rec)
    assert rec.calls == []  # no rank may be left half-way through group creation


def test_build_without_process_group_raises() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="not initialized"):
        topology.build(ranks_per_node=1)


def test_group_holds_its_handle_weakly() -> None:
    class Handle:  # stands in for a ProcessGroup, which takes weak references
        pass

    handle = Handle()
    g = Group((0, 1), handle)
    assert g.handle is handle
    del handle  # torch.distributed.destroy_process_group drops torch's references like this
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] was destroyed"):
        g.handle  # never None, which torch.distributed would read as the default group
    assert Group((0,)).handle is None  # a trivial group has no handle at all
