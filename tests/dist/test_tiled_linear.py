"""``zeropp.zero.TiledLinear`` under stage 3 on 2 nodes x 2 ranks: each tile is a gather unit of its own (inside a
block that is otherwise gathered whole), and the tiled layer computes what ``nn.Linear`` computes.

Bounds. A dot product of length n computed in fp32 differs from the exact one by at most
gamma_n * sum |a_k b_k|, gamma_n = n u / (1 - n u), u = 2^-24; two orders of the same sum differ by at most twice
that. Splitting the input features into s parts adds s - 1 additions, so n = K + s. With qwZ each weight the
forward uses is off by at most half a quantization step, absmax(block) / 254 <= max|W| / 254, so two layouts of
the same weights differ by at most 2 max|W| / 254 * sum_k |x_k| per output, plus the fp32 term.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeropp
from zeropp.zero import TiledLinear
from zeropp.zero.param_state import full_grad, locate
from support.world import run_world

IN, OUT, ROWS, LR = 50, 70, 12, 1e-3
U = 2.0 ** -24
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
CASES = {"out3": (1, 3, {}), "in3_out2": (3, 2, {}), "zeropp_in2_out2": (2, 2, ZEROPP)}


class Block(nn.Module):
    """The Linear and a parameter of the block's own (a gain of ones: the values pass unchanged)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.proj = linear
        self.gain = nn.Parameter(torch.ones(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.gain


class Net(nn.Module):
    """One block in an ``nn.ModuleList`` (gathered whole at "block" granularity), the Linear inside it."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(linear)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _run(rank: int, linear: nn.Module, zero: dict) -> dict:
    torch.manual_seed(1)
    model = Net(linear)
    config = {"train_micro_batch_size_per_gpu": ROWS, "topology": {"ranks_per_node": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, **zero}}
    engine, *_ = zeropp.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(ROWS, IN, generator=g).requires_grad_(True)
    target = torch.randn(ROWS, OUT, generator=g)
    y = engine(x)
    engine.backward((y * target).sum() / ROWS)  # linear in y: the same output gradient for both layouts
    grads = {n: full_grad(locate(p)) for n, p in engine.module.named_parameters()}
    engine.step()
    units = [sorted(s.name for s in u.slots) for u in engine.units]
    out = {"y": y.detach(), "dx": x.grad.detach(), "state": engine.consolidated_state_dict(), "grads": grads,
           "units": units, "gathered_peak": engine.memory_report()["gathered_weights_peak"],
           "x": x.detach(), "target": target}
    engine.close()
    return out


def worker(rank: int, world: int) -> dict:
    out = {}
    for name, (ins, outs, zero) in CASES.items():
        torch.manual_seed(0)
        lin = nn.Linear(IN, OUT)
        out[name, "linear"] = _run(rank, lin, zero)
        torch.manual_seed(0)
        plain = nn.Linear(IN, OUT)
        tiled = TiledLinear(IN, OUT, in_splits=ins, out_splits=outs, init_linear=plain)
        out[name, "tiled"] = _run(rank, tiled, zero)
        out[name, "weight0"], out[name, "bias0"] = plain.weight.detach().clone(), plain.bias.detach().clone()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(worker, 4, ranks_per_node=2)


def _stitched(state: dict, ins: int, outs: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = "blocks.0.proj.linears"
    weight = torch.cat([torch.cat([state[f"{p}.{o}.{i}.weight"] for i in range(ins)], dim=1) for o in range(outs)])
    bias = torch.cat([state[f"{p}.{o}.{ins - 1}.bias"] for o in range(outs)])
    for o in range(outs):
        for i in range(ins - 1):
            assert f"{p}.{o}.{i}.bias" not in state  # one bias per output split, on its last tile (DeepSpeed's)
    return weight, bias


def _fp32_bound(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """2 gamma_n |a| |b|: the most two summation orders of ``a @ b`` can differ by, elementwise."""
    gamma = n * U / (1 - n * U)
    return 2 * gamma * (a.abs() @ b.abs())


def _adamw_step(w0: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One step of torch's AdamW from ``w0`` with ``grad``: what the engine's step must give."""
    w = w0.clone().requires_grad_(True)
    w.grad = grad.clone()
    torch.optim.AdamW([w], lr=LR, weight_decay=0.0).step()
    return w.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_every_tile_is_a_unit_of_its_own_and_a_gather_holds_one_tile(results: list[dict], case: str) -> None:
    ins, outs, _ = CASES[case]
    for rep in results:
        units = rep[case, "tiled"]["units"]
        tiles = [u for u in units if any(".linears." in n for n in u)]
        assert len(tiles) == ins * outs, units
        for u in tiles:  # one tile's weight (and its bias), nothing else
            assert len({n.rsplit(".", 1)[0] for n in u}) == 1, u
        assert ["blocks.0.gain"] in units  # the block keeps the rest
        tile = -(-OUT // outs) * (-(-IN // ins) + 1)  # the largest tile's elements, bias included
        whole = OUT * (IN + 1)
        # the block's gain, the tile computing and one prefetched: never the whole operator
        assert rep[case, "tiled"]["gathered_peak"] <= 4 * (OUT + 2 * tile + 64) < 4 * whole, case
        assert rep[case, "linear"]["gathered_peak"] >= 4 * whole


@pytest.mark.parametrize("case", ["out3", "in3_out2"])
def test_fp32_tiles_compute_the_linears_values(results: list[dict], case: str) -> None:
    ins, outs, _ = CASES[case]
    w0, b0 = results[0][case, "weight0"], results[0][case, "bias0"]
    # the weight gradient is the mean over ranks of dy^T x: each rank's within the bound, the mean of 4 too
    grad_bound = sum(_fp32_bound((r[case, "tiled"]["target"] / ROWS).t(), r[case, "tiled"]["x"], ROWS + 1)
                     for r in results) / len(results)
    for rep in results:
        t, l = rep[case, "tiled"], rep[case, "linear"]
        # outputs: the same dot products, summed over the input splits in split order (the BLAS picks its
        # own order per shape, so even one input split is not promised the same bits)
        assert ((t["y"] - l["y"]).abs() <= _fp32_bound(t["x"], w0.t(), IN + ins + 1) + 1e-30).all()
        dy = t["target"] / ROWS  # the output gradient (the gain is 1)
        # the input gradient sums over the output splits, in autograd's order
        assert ((t["dx"] - l["dx"]).abs() <= _fp32_bound(dy, w0, OUT + outs + 1) + 1e-30).all()
        grads = {n.replace("blocks.0.proj.linears.", ""): g for n, g in t["grads"].items()}
        gw = torch.cat([torch.cat([grads[f"{o}.{i}.weight"] for i in range(ins)], dim=1) for o in range(outs)])
        gb = torch.cat([grads[f"{o}.{ins - 1}.bias"] for o in range(outs)])
        assert ((gw - l["grads"]["blocks.0.proj.weight"]).abs() <= 1.01 * grad_bound + 1e-30).all()
        assert ((gb - l["grads"]["blocks.0.proj.bias"]).abs() <= 1e-6 * gb.abs().max()).all()
        # one step: each tile moved exactly as torch's AdamW moves the stitched weight with the stitched gradient
        weight, bias = _stitched(t["state"], ins, outs)
        assert torch.equal(weight, _adamw_step(w0, gw)) and torch.equal(bias, _adamw_step(b0, gb))
        assert torch.equal(l["state"]["blocks.0.proj.weight"], _adamw_step(w0, l["grads"]["blocks.0.proj.weight"]))


def test_zeropp_tiles_stay_within_qwz_bound(results: list[dict]) -> None:
    case = "zeropp_in2_out2"
    ins, outs, _ = CASES[case]
    w0 = results[0][case, "weight0"]
    for rep in results:
        t, l = rep[case, "tiled"], rep[case, "linear"]
        qstep = 2 * w0.abs().max() / 254 * 1.001
        x = t["x"]
        bound = qstep * x.abs().sum(dim=1, keepdim=True) + _fp32_bound(x, w0.t(), IN + ins + 1) + 1e-6
        assert ((t["y"] - l["y"]).abs() <= bound).all()
        assert 0 < (t["y"] - l["y"]).abs().max()  # quantized in different blocks: not the same bits
        # one step: each tile moved as torch's AdamW moves the stitched weight with the (qgZ-reduced) gradient
        grads = {n.replace("blocks.0.proj.linears.", ""): g for n, g in t["grads"].items()}
        gw = torch.cat([torch.cat([grads[f"{o}.{i}.weight"] for i in range(ins)], dim=1) for o in range(outs)])
        weight, _ = _stitched(t["state"], ins, outs)
        assert torch.equal(weight, _adamw_step(w0, gw))
        assert ((weight - l["state"]["blocks.0.proj.weight"]).abs() <= 2 * LR * 1.0001).all()
