"""Frozen parameters in units of their own (Note [frozen units] in ``partition/unit.py``) against the layout
before them (each module's parameters in one unit), on the LoRA fine-tune of ``bench_frozen_quantized.py``.

The same ``transformers`` Llama (hidden 512, 4 layers, 15.8M parameters, all frozen) with rank-8 adapters on
every q and v projection, bf16, stage 3, 2 simulated nodes x 2 gloo ranks, micro-batch 2 x 128 tokens, once
as plain ZeRO-3 and once with qwZ + hpZ + qgZ. Each runs as ``whole`` (a decoder layer's adapters and frozen
weights in one unit: what the engine built before) and ``apart`` (today's engine); the engines of a pair
train on the same batches with their steps interleaved. Reported: model states by kind, gather bytes of the
last step by pass and link, the losses (bit-equal is expected) and the median step time after the first.

    .venv/bin/python bench/bench_frozen_units.py [--steps 6] [--out bench/results/frozen_units.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bench_frozen_quantized import MICRO, _model, train_interleaved  # noqa: E402
from results_io import RESULTS, write_results  # noqa: E402

SYSTEMS = {"zero3": {}, "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                   "zero_quantized_gradients": True}}


def _engine(zero: dict, whole: bool):
    import zeropp
    from zeropp.zero.engine import ZeroEngine
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, **zero}, "topology": {"ranks_per_node": 2}}
    split = ZeroEngine._split_frozen
    if whole:  # the unit layout before frozen units: a module's parameters in one unit, frozen or not
        ZeroEngine._split_frozen = lambda self, params: [(params, False)]  # type: ignore[method-assign]
    try:
        return zeropp.initialize(model=_model(), config=cfg)[0]
    finally:
        ZeroEngine._split_frozen = split  # type: ignore[method-assign]


def worker(rank: int, world: int, steps: int) -> dict:
    out: dict = {}
    for system, zero in SYSTEMS.items():
        engines = {"whole": _engine(zero, True), "apart": _engine(zero, False)}
        times, losses = train_interleaved(engines, rank, world, steps)
        for name, engine in engines.items():
            out[f"{system}_{name}"] = {"median_step_s": statistics.median(times[name][1:]), "losses": losses[name],
                                       "model_states": engine.model_state_bytes(), "comm": engine.comm_report(),
                                       "units": len(engine.units)}
        del engines
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=os.path.join(RESULTS, "frozen_units.json"))
    args = ap.parse_args()
    from support.world import run_world
    res = run_world(worker, 4, args.steps, ranks_per_node=2)[0]
    for system in SYSTEMS:
        whole, apart = res[f"{system}_whole"], res[f"{system}_apart"]
        apart["losses_equal_whole"] = apart["losses"] == whole["losses"]
        apart["step_time_ratio_vs_whole"] = apart["median_step_s"] / whole["median_step_s"]
        for name, r in (("whole", whole), ("apart", apart)):
            ms, comm = r["model_states"], r["comm"]
            fwd, bwd = comm["forward_gather"], comm["backward_gather"]
            print(f"{system:6s} {name:5s} units {r['units']:3d}  states/rank {ms['total']:>11,} B "
                  f"(grad rows {ms['grad_shard']:>10,})  forward gather {sum(fwd.values()):>11,} B  backward "
                  f"gather {sum(bwd.values()):>11,} B (inter-node {bwd['inter_node_bytes']:>10,})  step "
                  f"{r['median_step_s']:.2f} s")
        print(f"{system}: losses equal {apart['losses_equal_whole']}, step time apart / whole "
              f"{apart['step_time_ratio_vs_whole']:.3f}")
    res["command"] = "python bench/bench_frozen_units.py " + " ".join(sys.argv[1:])
    write_results(args.out, res)


if __name__ == "__main__":
    main()
