"""CommLedger bookkeeping, Comm's per-peer link split (on a Topology built with a fake ``new_group``, no process
group), and the analytic volume / memory formulas of ``zeropp.accounting`` on cases worked out by hand."""
from __future__ import annotations

import pytest
import torch

from zeropp import accounting, topology
from zeropp.accounting import Volume
from zeropp.comm.ledger import CommLedger, Link, Phase, Tally
from zeropp.comm.ops import Comm
from zeropp.topology import Group, Layout

ZERO = {"intra_node_bytes": 0, "inter_node_bytes": 0}
PHASES = ["forward_gather", "backward_gather", "grad_reduce", "other"]


# ---------------------------------------------------------------------------------------------- ledger
def test_empty_report_has_four_phases_of_zero() -> None:
    led = CommLedger()
    rep = led.last_step_report()
    assert list(rep) == PHASES
    assert all(v == ZERO for v in rep.values())
    assert led.current_report() == rep


def test_record_close_step_and_report() -> None:
    led = CommLedger()
    led.record(Phase.FORWARD_GATHER, 100, 40)
    led.record(Phase.FORWARD_GATHER, 10, 0)
    led.record(Phase.GRAD_REDUCE, 0, 7)
    assert led.current[(Phase.FORWARD_GATHER, Link.INTRA_NODE)] == Tally(110, 2)
    assert led.current[(Phase.FORWARD_GATHER, Link.INTER_NODE)] == Tally(40, 1)  # a zero is not a call
    assert led.current[(Phase.GRAD_REDUCE, Link.INTRA_NODE)] == Tally(0, 0)
    assert led.current_report()["forward_gather"] == {"intra_node_bytes": 110, "inter_node_bytes": 40}
    assert led.last_step_report()["forward_gather"] == ZERO  # nothing closed yet
    led.close_step()
    assert led.steps_closed == 1
    assert led.current == {}
    rep = led.last_step_report()
    assert rep["forward_gather"] == {"intra_node_bytes": 110, "inter_node_bytes": 40}
    assert rep["grad_reduce"] == {"intra_node_bytes": 0, "inter_node_bytes": 7}
    assert rep["backward_gather"] == ZERO and rep["other"] == ZERO

    # second step: last_step shows only step 2, total accumulates
    led.record(Phase.BACKWARD_GATHER, 3, 5)
    assert led.last_step_report()["backward_gather"] == ZERO  # still the closed step
    led.close_step()
    assert led.steps_closed == 2
    rep2 = led.last_step_report()
    assert rep2["backward_gather"] == {"intra_node_bytes": 3, "inter_node_bytes": 5}
    assert rep2["forward_gather"] == ZERO
    tot = CommLedger.report(led.total)
    assert tot["forward_gather"] == {"intra_node_bytes": 110, "inter_node_bytes": 40}
    assert tot["backward_gather"] == {"intra_node_bytes": 3, "inter_node_bytes": 5}
    assert led.total[(Phase.FORWARD_GATHER, Link.INTRA_NODE)].calls == 2


def test_record_coerces_to_int() -> None:
    led = CommLedger()
    led.record(Phase.OTHER, torch.tensor(12), 3.0)  # type: ignore[arg-type]
    v = led.current_report()["other"]
    assert v == {"intra_node_bytes": 12, "inter_node_bytes": 3}
    assert all(type(x) is int for x in v.values())


def test_reset() -> None:
    led = CommLedger()
    led.record(Phase.OTHER, 1, 2)
    led.close_step()
    led.record(Phase.OTHER, 4, 8)
    led.reset()
    assert led.steps_closed == 0
    assert led.current == {} and led.last_step == {} and led.total == {}
    assert led.last_step_report()["other"] == ZERO


def test_phase_values_are_the_report_keys() -> None:
    assert [p.value for p in Phase] == PHASES
    assert [link.value for link in Link] == ["intra_node", "inter_node"]


# ---------------------------------------------------------------------------------------------- Comm
def _topo(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, d: int, s: int = 1) -> topology.Topology:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return topology.build(ranks_per_node=d, hpz_partition_size=s, new_group=lambda ranks: None)


@pytest.mark.parametrize("rank", range(4))
def test_record_per_peer_2x2(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    topo = _topo(monkeypatch, rank, 4, 2)
    led = CommLedger()
    comm = Comm(topo, led)
    comm._record_per_peer(topo.world, 10, Phase.FORWARD_GATHER)  # 1 peer on my node, 2 elsewhere
    comm._record_per_peer(topo.intra_node, 100, Phase.BACKWARD_GATHER)  # 1 peer, same node
    comm._record_per_peer(topo.inter_node, 1000, Phase.GRAD_REDUCE)  # 1 peer, other node
    rep = led.current_report()
    assert rep["forward_gather"] == {"intra_node_bytes": 10, "inter_node_bytes": 20}
    assert rep["backward_gather"] == {"intra_node_bytes": 100, "inter_node_bytes": 0}
    assert rep["grad_reduce"] == {"intra_node_bytes": 0, "inter_node_bytes": 1000}
    assert rep["other"] == ZERO


def test_record_per_peer_3x2_arbitrary_group(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = _topo(monkeypatch, 3, 6, 2)  # rank 3: node 1 = {2, 3}
    led = CommLedger()
    Comm(topo, led)._record_per_peer(Group((0, 2, 3, 4, 5)), 7, Phase.OTHER)
    # peers: 2 on my node; 0, 4, 5 on other nodes; myself not counted
    assert led.current_report()["other"] == {"intra_node_bytes": 7, "inter_node_bytes": 21}


def test_record_per_peer_one_node_and_one_rank_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = _topo(monkeypatch, 0, 4, 4)
    led = CommLedger()
    Comm(topo, led)._record_per_peer(topo.world, 5, Phase.OTHER)
    assert led.current_report()["other"] == {"intra_node_bytes": 15, "inter_node_bytes": 0}
    topo = _topo(monkeypatch, 0, 4, 1)
    led = CommLedger()
    Comm(topo, led)._record_per_peer(topo.world, 5, Phase.OTHER)
    assert led.current_report()["other"] == {"intra_node_bytes": 0, "inter_node_bytes": 15}


def test_single_member_group_is_local_copy_and_free(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = _topo(monkeypatch, 2, 4, 2)  # inter group of 2, intra of 2; singleton hpZ group (s=1)
    assert topo.hpz.size == 1
    led = CommLedger()
    comm = Comm(topo, led)
    inp = torch.arange(6.0)
    out = torch.empty(6)
    h = comm.all_gather(out, inp, topo.hpz, Phase.FORWARD_GATHER)
    h.wait()
    assert torch.equal(out, inp)
    out2 = torch.empty(6)
    comm.all_to_all(out2, inp, topo.hpz, Phase.GRAD_REDUCE).wait()
    assert torch.equal(out2, inp)
    comm.all_reduce(inp, topo.hpz)
    comm.broadcast(inp, 2, topo.hpz)
    assert led.current == {}  # nothing moved, nothing recorded


def test_collective_shape_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = _topo(monkeypatch, 0, 4, 2)
    led = CommLedger()
    comm = Comm(topo, led)
    with pytest.raises(ValueError, match="all_gather"):
        comm.all_gather(torch.empty(7), torch.empty(2), topo.world, Phase.OTHER)
    with pytest.raises(ValueError, match="all_to_all"):
        comm.all_to_all(torch.empty(6), torch.empty(6), topo.world, Phase.OTHER)
    assert led.current == {}  # rejected before recording


# ---------------------------------------------------------------------------------------------- accounting
# numels [5, 8] on 2 nodes x 2 ranks (W = 4), rank 0 (node 0 = {0, 1}):
#   chunk(5) = max(2, 2*ceil(5/8)) = 2, chunk(8) = 2*ceil(8/8) = 2 -> row of 4 elements, padded sizes 8, 8.
#   peers of rank 0 in the world: 1 on its node (rank 1), 2 elsewhere (ranks 2, 3).
#   plain bf16 row: 4 x 2 B = 8 B. The all-to-all reduce-scatter receives one row from each peer: intra 8,
#   inter 16. A gather over the world takes two hops (Note [two-hop gather]): the row of the one rank with
#   this local index on the other node (inter 8), then the 2 rows the node's other rank now holds (intra 16).
L22 = Layout(4, 2)
NUMELS = [5, 8]


@pytest.mark.parametrize("rank", range(4))
def test_gather_and_reduce_scatter_hand(rank: int) -> None:
    assert accounting.gather_volume(NUMELS, L22, rank, 2) == Volume(16, 8)
    assert accounting.gather_volume(NUMELS, L22, rank, 4) == Volume(32, 16)  # fp32
    assert accounting.reduce_scatter_volume(NUMELS, L22, rank, 2) == Volume(8, 16)


def test_gather_with_padding_hand() -> None:
    # [5, 13] on W = 4: chunks 2 and 2*ceil(13/8) = 4 -> row 6 elements, 12 B in bf16.
    assert accounting.gather_volume([5, 13], L22, 3, 2) == Volume(24, 12)
    # 3 nodes x 2: [7] -> chunk 2*ceil(7/12) = 2 -> a row of 4 B; 2 rows from the other nodes, then the other
    # rank of the node's 3 rows
    assert accounting.gather_volume([7], Layout(6, 2), 2, 2) == Volume(12, 8)
    # one node, or one rank per node: one all-gather, a row from every other rank
    assert accounting.gather_volume([7], Layout(6, 6), 2, 2) == Volume(20, 0)
    assert accounting.gather_volume([7], Layout(6, 1), 2, 2) == Volume(0, 20)


def test_quantized_gather_hand() -> None:
    # int8, block 4: segments (2, 2) -> 2 blocks; payload 4 B + 2 scales x 4 B = a row of 12 B
    assert accounting.quantized_gather_volume(NUMELS, L22, 0, 8, 4) == Volume(24, 12)
    # int4: payload ceil(4/2) = 2 B + 8 B of scales = 10 B
    assert accounting.quantized_gather_volume(NUMELS, L22, 0, 4, 4) == Volume(20, 10)
    # block 2 with [5, 13]: segments (2, 4) -> 1 + 2 = 3 blocks; int8 payload 6 + 12 = 18 B
    assert accounting.quantized_gather_volume([5, 13], L22, 1, 8, 2) == Volume(36, 18)


@pytest.mark.parametrize("rank", range(4))
def test_hpz_gather_hand(rank: int) -> None:
    # s = 2: secondary slices padded/2 = 4 + 4 elements = 16 B bf16, from the 1 other member of the group,
    # which is on this rank's node (groups {0,1}, {2,3} = the nodes)
    assert accounting.hpz_gather_volume(NUMELS, L22, rank, 2, 2) == Volume(16, 0)
    # s = 4: slices of 2 + 2 = 8 B from 1 peer on the node and 2 off it (one all-gather over the hpZ group)
    assert accounting.hpz_gather_volume(NUMELS, L22, rank, 4, 2) == Volume(8, 16)


def test_hpz_group_crossing_nodes_hand() -> None:
    # 4 nodes x 1 rank, s = 2: the group {2, 3} spans two nodes, so rank 3 receives 16 B over the slow link
    assert accounting.hpz_gather_volume(NUMELS, Layout(4, 1), 3, 2, 2) == Volume(0, 16)


def test_qgz_volume_hand() -> None:
    # int4, block 4: row = 2 B payload + 8 B scales = 10 B. d = 2, n = 2:
    # hop 1 receives n rows from each of d-1 node mates = 20 B; hop 2 one row from each of n-1 nodes = 10 B
    assert accounting.qgz_volume(NUMELS, L22, 0, 4, 4) == Volume(20, 10)
    # int8: row 4 + 8 = 12
    assert accounting.qgz_volume(NUMELS, L22, 0, 8, 4) == Volume(24, 12)


def test_qgz_volume_one_node_and_one_rank_per_node() -> None:
    one_node = accounting.qgz_volume(NUMELS, Layout(4, 4), 0, 4, 4)
    assert one_node.inter_node_bytes == 0
    assert one_node == Volume(3 * 1 * 10, 0)
    one_per_node = accounting.qgz_volume(NUMELS, Layout(4, 1), 0, 4, 4)
    assert one_per_node.intra_node_bytes == 0
    assert one_per_node == Volume(0, 3 * 10)


def test_grad_norm_volume_hand() -> None:
    # ring all-reduce of one float64 over 4: 2 * 8 // 4 = 4 B per peer; 13 float64 (the norm and three groups of
    # four order values): 52 B per peer, one peer on this node and two on the other
    assert accounting.grad_norm_volume(L22, 0) == Volume(52, 104)


def test_model_state_bytes_hand() -> None:
    # row of 4 elements per rank: (2 + 2 + 12) x 4 = 64 B
    assert accounting.model_state_bytes(NUMELS, 4) == 64
    # hpZ s = 2 adds the bf16 secondary slice: padded/2 = 4 + 4 elements = 16 B
    assert accounting.model_state_bytes(NUMELS, 4, hpz_group=2) == 80
    # fp32 training, no separate 16-bit shard, fp32 grads, Adam state 8 + master 4 counted as K = 12
    assert accounting.model_state_bytes(NUMELS, 4, grad_bytes=4, optimizer_bytes=12, shard_bytes=0) == 64
    # one rank: chunks 2*ceil(5/2) = 6 and 8 -> 14 elements x 16 B
    assert accounting.model_state_bytes(NUMELS, 1) == 224


def test_volume_add_and_dict() -> None:
    v = Volume(1, 2) + Volume(10, 20)
    assert v == Volume(11, 22)
    assert v.as_dict() == {"intra_node_bytes": 11, "inter_node_bytes": 22}
