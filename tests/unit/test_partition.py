"""Partition arithmetic (Note [shard layout] in partition/spec.py), gather-unit planning (tied weights go to the
lowest common ancestor) and the Unit's materialize / release / refresh life cycle."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zeropp.partition.assign import granular_leaves, granularities, plan_units
from zeropp.partition.spec import RowLayout, ShardSpec, take_chunk
from zeropp.partition.unit import Unit, UnitState

NUMELS = (0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 64, 99, 1000, 1001)
PAIRS = [(n, w) for n in NUMELS for w in (1, 2, 3, 4, 5, 6, 7, 8, 16)]


# ---------------------------------------------------------------------------------------------- ShardSpec
@pytest.mark.parametrize("numel,world", PAIRS)
def test_chunk_even_minimal_and_covering(numel: int, world: int) -> None:
    spec = ShardSpec(numel, torch.Size([numel]), world)
    c = spec.chunk
    assert c % 2 == 0 and c >= 2
    assert spec.padded == c * world >= numel
    if c > 2:  # the smallest even chunk that covers numel
        assert (c - 2) * world < numel


@pytest.mark.parametrize("numel,world", PAIRS)
def test_owned_ranges_tile_exactly(numel: int, world: int) -> None:
    spec = ShardSpec(numel, torch.Size([numel]), world)
    covered = []
    prev_stop = 0
    for r in range(world):
        start, stop = spec.owned(r)
        assert start == prev_stop  # contiguous, in rank order
        assert 0 <= stop - start <= spec.chunk
        covered.extend(range(start, stop))
        prev_stop = stop
    assert covered == list(range(numel))


def test_chunk_hand_values() -> None:
    assert ShardSpec(5, torch.Size([5]), 2).chunk == 4  # ceil(5/2)=3 -> even 4
    assert ShardSpec(8, torch.Size([8]), 4).chunk == 2
    assert ShardSpec(9, torch.Size([9]), 4).chunk == 4
    assert ShardSpec(1, torch.Size([1]), 8).chunk == 2  # numel < world: minimum 2
    assert ShardSpec(3, torch.Size([3]), 4).owned(1) == (2, 3)
    assert ShardSpec(3, torch.Size([3]), 4).owned(2) == (3, 3)  # empty, past the end
    assert ShardSpec(3, torch.Size([3]), 4).owned(3) == (3, 3)


def test_chunk_for_group_sizes() -> None:
    spec = ShardSpec(15, torch.Size([3, 5]), 4)  # chunk 4, padded 16
    assert spec.chunk_for(4) == 4 and spec.chunk_for(2) == 8 and spec.chunk_for(1) == 16
    with pytest.raises(ValueError, match="does not split"):
        spec.chunk_for(3)


@pytest.mark.parametrize("numel,world", [(5, 2), (1, 4), (7, 3), (16, 4), (13, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_take_chunk_zero_pads(numel: int, world: int, dtype: torch.dtype) -> None:
    full = (torch.arange(numel, dtype=torch.float32) + 1).to(dtype)  # no zeros in the real data
    spec = ShardSpec(numel, full.shape, world)
    for g in (d for d in (1, 2, world) if world % d == 0):
        c = spec.chunk_for(g)
        chunks = [take_chunk(full, spec, i, g) for i in range(g)]
        for ch in chunks:
            assert ch.shape == (c,) and ch.dtype == dtype
        cat = torch.cat(chunks)
        assert torch.equal(cat[:numel], full)
        assert torch.count_nonzero(cat[numel:]) == 0  # padding is exact zeros
        assert cat.numel() == spec.padded


def test_take_chunk_is_a_copy() -> None:
    full = torch.arange(8.0).view(2, 4)
    spec = ShardSpec(8, full.shape, 2)
    ch = take_chunk(full, spec, 1, 2)
    assert torch.equal(ch, torch.tensor([4.0, 5, 6, 7]))
    ch.zero_()
    assert full[1, 0] == 4.0


def test_take_chunk_hand_case() -> None:
    full = torch.tensor([1.0, 2, 3, 4, 5])
    spec = ShardSpec(5, full.shape, 2)  # chunk 4
    assert torch.equal(take_chunk(full, spec, 0, 2), torch.tensor([1.0, 2, 3, 4]))
    assert torch.equal(take_chunk(full, spec, 1, 2), torch.tensor([5.0, 0, 0, 0]))
    assert torch.equal(take_chunk(full, spec, 0, 1), torch.tensor([1.0, 2, 3, 4, 5, 0, 0, 0]))


def test_row_layout_offsets() -> None:
    row = RowLayout((4, 2, 6, 2))
    assert row.offsets == (0, 4, 6, 12)
    assert row.numel == 14
    assert RowLayout(()).offsets == () and RowLayout(()).numel == 0


# ---------------------------------------------------------------------------------------------- plan_units
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))  # the block's own parameter, beside children
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight  # tied


def _units(model: nn.Module) -> dict[str, list[str]]:
    return {u.module_name: [n for n, _ in u.params] for u in plan_units(model)}


def test_tied_parameter_goes_to_common_ancestor_once() -> None:
    model = TiedModel()
    units = _units(model)
    all_names = [n for names in units.values() for n in names]
    assert all_names.count("wte.weight") == 1
    assert "head.weight" not in all_names  # the second name of the same tensor is not a second parameter
    assert units[""] == ["wte.weight"]  # common ancestor of 'wte' and 'head' is the root
    assert "wte" not in units and "head" not in units  # nothing else in them
    # every unique parameter appears exactly once, by identity
    got = [id(p) for u in plan_units(model) for _, p in u.params]
    assert sorted(got) == sorted(id(p) for p in model.parameters())


def test_nested_module_own_params_and_children() -> None:
    units = _units(TiedModel())
    assert units["blocks.0"] == ["blocks.0.gain"]
    assert units["blocks.0.fc"] == ["blocks.0.fc.weight", "blocks.0.fc.bias"]
    assert units["blocks.1.ln"] == ["blocks.1.ln.weight", "blocks.1.ln.bias"]
    assert "blocks" not in units  # a Sequential holds no parameter of its own


def test_frozen_params_included() -> None:
    model = TiedModel()
    units = {u.module_name: u for u in plan_units(model)}
    names = [n for n, _ in units["frozen"].params]
    assert names == ["frozen.weight", "frozen.bias"]
    assert units["frozen"].params[0][1] is model.frozen.weight
    assert units["frozen"].module is model.frozen


def test_units_in_module_definition_order() -> None:
    order = [u.module_name for u in plan_units(TiedModel())]
    assert order == ["", "blocks.0", "blocks.0.fc", "blocks.0.ln", "blocks.1", "blocks.1.fc", "blocks.1.ln", "frozen"]


def test_tie_inside_a_subtree_goes_to_that_subtree() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(3, 3)
            self.pair = Pair()

    units = _units(Outer())
    assert units["pair"] == ["pair.a.weight"]
    assert units["pair.a"] == ["pair.a.bias"] and units["pair.b"] == ["pair.b.bias"]
    assert "" not in units


def test_tie_between_root_and_child() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))
            self.child = nn.Module()
            self.child.w = self.w

    assert _units(Root()) == {"": ["w"]}


def test_prefix_sharing_names_are_not_ancestors() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Module()
            self.layer.x = nn.Linear(2, 2)
            self.layer2 = nn.Module()
            self.layer2.x = nn.Linear(2, 2)
            self.layer2.x.weight = self.layer.x.weight

    units = _units(M())
    # 'layer.x' and 'layer2.x' share only the root; a string-prefix bug would pick 'layer'
    assert units[""] == ["layer.x.weight"]


# ---------------------------------------------------------------------------------------------- Unit
def _make_unit(world: int, rank: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(3, 5)  # weight 15, bias 5
    vec = nn.Parameter(torch.empty(1))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(5, 3, generator=g))
        lin.bias.copy_(torch.randn(5, generator=g))
        vec.copy_(torch.randn(1, generator=g))
    named = [("w", lin.weight), ("b", lin.bias), ("v", vec)]
    originals = {n: p.detach().clone().to(dtype) for n, p in named}
    originals32 = {n: p.detach().clone() for n, p in named}
    unit = Unit(0, "lin", named, world, rank, dtype)
    return unit, named, originals, originals32


def _gathered_by_hand(originals: dict, unit: Unit, group: int) -> torch.Tensor:
    rows = []
    for i in range(group):
        parts = []
        for slot in unit.slots:
            parts.append(take_chunk(originals[slot.name], slot.spec, i, group))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def test_unit_row_and_master_shard_hand_values() -> None:
    unit, _, _, orig32 = _make_unit(world=4, rank=1, dtype=torch.float32)
    # chunks over 4 ranks: 15 -> 4, 5 -> 2, 1 -> 2
    assert unit.row.chunks == (4, 2, 2) and unit.row.offsets == (0, 4, 6)
    expected = torch.cat([orig32["w"].reshape(-1)[4:8], orig32["b"][2:4], torch.zeros(2)])
    assert torch.equal(unit.master, expected)
    assert unit.master.dtype == torch.float32
    assert [v.data_ptr() for v in unit.master_views()] == [
        unit.master[0:4].data_ptr(), unit.master[4:6].data_ptr(), unit.master[6:8].data_ptr()]
    assert unit.master_views() is unit.master_views()  # same objects every call (optimizer keys)
    assert unit.grad is None  # allocated on first use
    assert unit.grad_row().shape == (8,) and torch.count_nonzero(unit.grad_row()) == 0
    assert unit.grad is unit.grad_row()
    unit.drop_grad()
    assert unit.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [4, 2, 1])
def test_unit_release_materialize_round_trip(dtype: torch.dtype, group: int) -> None:
    unit, named, orig, _ = _make_unit(world=4, rank=2, dtype=dtype)
    assert unit.state is UnitState.SHARDED  # released at construction
    for (_, p), slot in zip(named, unit.slots):
        assert p.untyped_storage().nbytes() == 0
        assert slot.full.untyped_storage().nbytes() == 0
    shapes = [p.shape for _, p in named]
    assert shapes == [torch.Size([5, 3]), torch.Size([5]), torch.Size([1])]

    layout = unit.group_layout(group)
    gathered = _gathered_by_hand(orig, unit, group)
    assert gathered.shape == (group, layout.numel)
    for _ in range(2):  # twice: release then re-materialize restores the same values
        unit.materialize(gathered, layout)
        assert unit.state is UnitState.GATHERED
        for name, p in named:
            assert p.dtype == dtype and p.shape == orig[name].shape
            assert torch.equal(p.detach(), orig[name])  # exact
        for i in range(group):
            assert torch.equal(unit.full_chunk_row(i, group), gathered[i])
        unit.release()
        assert unit.state is UnitState.SHARDED
        for _, p in named:
            assert p.untyped_storage().nbytes() == 0
        assert [p.shape for _, p in named] == shapes  # autograd metadata unchanged


def test_full_chunk_row_matches_own_shard() -> None:
    """The row of index ``rank`` over the world is exactly the rank's own (fp32) master row."""
    world = 4
    for rank in range(world):
        unit, _, orig, _ = _make_unit(world, rank, torch.float32, seed=3)
        layout = unit.group_layout(world)
        unit.materialize(_gathered_by_hand(orig, unit, world), layout)
        assert torch.equal(unit.full_chunk_row(rank, world), unit.master)
        # hpZ split over 2: row i is the concatenation of each parameter's padded half
        row1 = unit.full_chunk_row(1, 2)
        w_half = torch.cat([orig["w"].reshape(-1), torch.zeros(1)])[8:16]
        assert torch.equal(row1[:8], w_half)


def test_fp32_master_is_shard() -> None:
    unit, _, _, _ = _make_unit(4, 0, torch.float32)
    assert unit.shard_row() is unit.master
    assert unit.kept_shard is None  # nothing held besides the master
    before = unit.version
    unit.master.add_(1.0)
    unit.refresh_shard_from_master()
    assert unit.version == before + 1
    assert torch.equal(unit.shard_row(), unit.master)


def test_bf16_master_separate_and_refresh() -> None:
    unit, _, _, orig32 = _make_unit(4, 1, torch.bfloat16)
    shard = unit.kept_shard
    assert shard is not None and shard is unit.shard_row() and shard is not unit.master
    assert shard.dtype == torch.bfloat16 and unit.master.dtype == torch.float32
    assert shard.data_ptr() != unit.master.data_ptr()
    assert torch.equal(shard, unit.master.to(torch.bfloat16))
    # the fp32 master keeps full precision (taken from the fp32 parameters, not from the bf16 cast)
    assert torch.equal(unit.master[:4], orig32["w"].reshape(-1)[4:8])
    assert unit.grad_row().dtype == torch.bfloat16
    v0 = unit.version
    unit.master.mul_(3.0).add_(0.001)
    assert not torch.equal(shard, unit.master.to(torch.bfloat16))  # stale until refreshed
    unit.refresh_shard_from_master()
    assert unit.version == v0 + 1
    assert torch.equal(shard, unit.master.to(torch.bfloat16))
    unit.refresh_shard_from_master()
    assert unit.version == v0 + 2


def test_unit_misc_views() -> None:
    unit, named, _, _ = _make_unit(2, 0, torch.float32)
    assert unit.segment_names() == ["w", "b", "v"]
    assert list(unit.params()) == [p for _, p in named]
    assert unit.needs_grad() == 3
    named[2][1].requires_grad_(False)
    assert unit.needs_grad() == 2
    gv = unit.grad_views()
    assert [v.numel() for v in gv] == list(unit.row.chunks)
    gv[1].fill_(7.0)
    assert torch.equal(unit.grad[unit.row.offsets[1]:unit.row.offsets[1] + unit.row.chunks[1]],
                       torch.full((unit.row.chunks[1],), 7.0))


def test_unit_with_an_empty_parameter() -> None:
    empty = nn.Parameter(torch.empty(0, 3))
    vec = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    orig = {"e": empty.detach().clone(), "v": vec.detach().clone()}
    unit = Unit(0, "m", [("e", empty), ("v", vec)], 4, 1, torch.float32)
    assert unit.row.chunks == (2, 2)  # an empty parameter still gets a (padding-only) chunk
    assert torch.equal(unit.master, torch.tensor([0.0, 0.0, 3.0, 0.0]))
    layout = unit.group_layout(4)
    unit.materialize(_gathered_by_hand(orig, unit, 4), layout)
    assert empty.shape == (0, 3) and torch.equal(vec.detach(), orig["v"])
    unit.release()
    assert empty.shape == (0, 3) and vec.shape == (3,)


class _Layered(nn.Module):
    """A transformer-like stack: embedding tied to the head, blocks in a ModuleList, a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(3))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_block_granularity_lifts_each_layer_into_one_unit() -> None:
    model = _Layered()
    by_module = {u.module_name: [n for n, _ in u.params] for u in plan_units(model, "block")}
    assert by_module == {
        "": ["embed.weight"],  # tied: lowest common ancestor, outside any block
        "blocks.0": ["blocks.0.0.weight", "blocks.0.0.bias", "blocks.0.1.weight", "blocks.0.1.bias"],
        "blocks.1": ["blocks.1.0.weight", "blocks.1.0.bias", "blocks.1.1.weight", "blocks.1.1.bias"],
        "blocks.2": ["blocks.2.0.weight", "blocks.2.0.bias", "blocks.2.1.weight", "blocks.2.1.bias"],
        "norm": ["norm.weight", "norm.bias"],
    }
    per_module = [u.module_name for u in plan_units(model, "module")]
    assert per_module == ["", "blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "blocks.2.0", "blocks.2.1",
                          "norm"]
    with pytest.raises(ValueError, match="granularity"):
        plan_units(model, "layer")


def test_an_uninitialized_lazy_parameter_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"'1\.weight' is not initialized yet .* before zeropp.initialize"):
        plan_units(model)
    model(torch.randn(1, 4))  # materialized by one forward: accepted
    assert [p.shape for u in plan_units(model) for _, p in u.params] == [(4, 4), (4,), (2, 4), (2,)]


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)  # 72 elements each


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)  # 16
        self.attn = _Attn()
        self.act = nn.GELU()  # no parameters: not a layer


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.head = nn.Linear(8, 64)  # 576


def test_granularity_scores_follow_deepspeeds_rule():
    """parameters // (1 + torch leaf layers with parameters); leaves, containers and empty modules never score."""
    model = _Stack()
    score = granularities(model)
    assert score[model.layers[0].attn] == 144 // 3  # q, o and itself
    assert score[model.layers[0]] == 160 // 5  # norm, q, o, attn, itself
    assert score[model] == (2 * 160 + 576) // (2 * 5 + 1 + 1)  # the ModuleList adds no layer of its own
    never = [model.layers, model.head, model.layers[0].norm, model.layers[0].act]
    assert all(score[m] == float("inf") for m in never)
    assert granular_leaves(model, 32) == list(model.layers)  # outermost first: the layers, not their attn
    assert granular_leaves(model, 48) == list(model.layers)
    assert granular_leaves(model, 31) == []
    assert granular_leaves(model, 74) == [model]
