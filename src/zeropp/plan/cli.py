"""``zeropp plan``: the command line over the cost model (``zeropp plan --help``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from zeropp.plan.profile import PlanError

DESCRIPTION = (
    "Predict, for a model and a cluster, the step time, tokens/s and memory per rank of ZeRO stages 0-3 with and "
    "without each ZeRO++ technique and optimizer offload; print them ranked and the config JSON of the fastest "
    "one that fits. --calibrate measures this machine (or, with --cluster, the emulated cluster of `zeropp "
    "bench`; under torchrun, the real one) and writes a profile that --profile reads. See docs/plan.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibrate", action="store_true", help="measure compute, quantizer, host work and links; "
                   "write a profile (--out)")
    p.add_argument("--out", default="plan_profile.json", help="profile written by --calibrate "
                   "(default: plan_profile.json)")
    p.add_argument("--cluster", action="store_true", help="with --calibrate: on the emulated cluster (root; "
                   "network namespaces and tc, as `zeropp bench`), once per --bandwidths setting")
    p.add_argument("--bandwidths", default="unlimited,1gbit,200mbit,100mbit",
                   help="with --calibrate --cluster: link settings to measure (default: the bench's four)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="with --calibrate --cluster: ranks per emulated "
                   "node (default: 2); --nodes gives the node count (default there: 2)")
    p.add_argument("--model", default=None, help="a parameter count (18B, 1.3e9), a Hugging Face config.json, or "
                   "a zeropp/DeepSpeed config JSON (then give --params; its batch and bucket settings are used)")
    p.add_argument("--params", default=None, help="the model size when --model is a DeepSpeed config")
    p.add_argument("--nodes", type=int, default=None, help="nodes in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks (GPUs) per node")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="each node's link to the others, Gbit/s")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="each GPU's link inside a node, Gbit/s "
                   "(NVLink/NVSwitch: thousands)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="achieved (not peak) TFLOP/s per GPU on the "
                   "model's matmuls, e.g. 40-50%% of peak (with --profile: default the measured rate)")
    p.add_argument("--memory-gib", type=float, default=None, help="accelerator memory per rank, GiB")
    p.add_argument("--profile", default=None, help="a profile written by --calibrate: measured speeds replace the "
                   "defaults (see docs/plan.md)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per micro-step (default: the "
                   "DeepSpeed config's, else 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 2048, or the HF "
                   "config's context if shorter)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per optimizer step (default: the "
                   "config's, else 1)")
    p.add_argument("--bucket", type=float, default=None, help="reduce_bucket_size in elements (default: the "
                   "config's, else the engine's default for the model)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing (one more forward)")
    p.add_argument("--fp32", action="store_true", help="compute in fp32 (default: bf16)")
    p.add_argument("--all-bits", action="store_true", help="also rank qwZ int4 and qgZ int8")
    p.add_argument("--no-offload", action="store_true", help="leave optimizer offload out of the ranking")
    p.add_argument("--top", type=int, default=0, help="print only the first N rows (default: all)")
    p.add_argument("--json", default=None, help="also write the table and the best config to this JSON file")


def _int_option(value: Optional[int], name: str, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise PlanError(f"{name}: must be a positive integer, got {value}")
    return value


def _workload(args: argparse.Namespace, model: Any, base: Optional[dict[str, Any]]) -> Any:
    from zeropp.bucket_sizes import default_reduce_bucket_size
    from zeropp.plan.schedule import Workload

    zero = (base or {}).get("zero_optimization") or {}
    micro = args.micro_batch if args.micro_batch is not None else (base or {}).get("train_micro_batch_size_per_gpu", 1)
    gas = args.grad_accum if args.grad_accum is not None else (base or {}).get("gradient_accumulation_steps", 1)
    seq_default = min(2048, model.seq_len_max) if model.seq_len_max else 2048
    bucket = args.bucket if args.bucket is not None else zero.get("reduce_bucket_size")
    if bucket is None:  # the engine's default for this model (Note [bucket size])
        bucket = default_reduce_bucket_size(model.params)
    for name, value in (("--micro-batch", micro), ("--grad-accum", gas)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}: must be a positive integer, got {value!r}")
    try:
        bucket = int(float(bucket))
    except (TypeError, ValueError):
        raise PlanError(f"--bucket: must be a number of elements, got {bucket!r}") from None
    if bucket < 1:
        raise PlanError(f"--bucket: must be >= 1, got {bucket}")
    prefetch, live = zero.get("stage3_prefetch_bucket_size"), zero.get("stage3_max_live_parameters")
    return Workload(micro, _int_option(args.seq_len, "--seq-len", seq_default), gas, bucket,
                    int(zero.get("quantization_block_size", 2048)), not args.fp32, args.checkpointing,
                    prefetch_bucket=None if prefetch is None else int(float(prefetch)),
                    max_live=None if live is None else int(float(live)))


def _model(args: argparse.Namespace) -> tuple[Any, Optional[dict[str, Any]]]:
    from zeropp.plan.model import gpt_of_size, load_model, parse_params

    if not args.model:
        raise PlanError("--model: required (a parameter count, an HF config.json or a DeepSpeed config)")
    model, base = load_model(args.model)
    if base is not None:
        from zeropp.config import ConfigError, load_config

        try:
            load_config(base)
        except ConfigError as err:
            raise PlanError(f"--model {args.model}: {err}") from None
        count = parse_params(args.params) if args.params else None
        if count is None:
            raise PlanError(f"--params: --model {args.model} is a DeepSpeed config, which has no model size; give "
                            "--params (like 18B)" + (f", got {args.params!r}" if args.params else ""))
        model = gpt_of_size(count)
    elif args.params:
        raise PlanError("--params: only with a DeepSpeed config as --model")
    return model, base


def _hardware(args: argparse.Namespace) -> Any:
    from zeropp.plan.hardware import from_profile, gpu_cluster
    from zeropp.plan.profile import load_profile

    nodes = _int_option(args.nodes, "--nodes", 0) if args.nodes is not None else None
    gpn = _int_option(args.gpus_per_node, "--gpus-per-node", 0) if args.gpus_per_node is not None else None
    if nodes is None or gpn is None:
        raise PlanError(("--nodes" if nodes is None else "--gpus-per-node") + ": required")
    if args.memory_gib is None:
        raise PlanError("--memory-gib: required (accelerator memory per rank)")
    if args.profile:
        profile = load_profile(args.profile)
        return from_profile(profile, nodes, gpn, args.memory_gib, args.inter_node_gbps, None, args.gpu_tflops,
                            args.intra_node_gbps)
    for name, value in (("--inter-node-gbps", args.inter_node_gbps), ("--intra-node-gbps", args.intra_node_gbps),
                        ("--gpu-tflops", args.gpu_tflops)):
        if value is None:
            raise PlanError(f"{name}: required without --profile")
    return gpu_cluster(nodes, gpn, args.gpu_tflops, args.inter_node_gbps, args.intra_node_gbps, args.memory_gib)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def table(rows: list[Any], top: int = 0) -> str:
    lines = ["| # | configuration | step s | tokens/s | model states GiB/rank | need GiB/rank | fits | inter-node "
             "MB/step/rank | exposed comm s |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows[: top or len(rows)], 1):
        lines.append(f"| {i} | {r.choice.label} | {r.time.step_s:.3f} | {r.tokens_per_s:,.0f} | "
                     f"{_gib(r.memory.states['total'])} | {_gib(r.memory.need)} | {'yes' if r.fits else 'no'} | "
                     f"{r.inter_bytes / 1e6:,.1f} | {r.time.exposed_comm_s:.3f} |")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    from zeropp.plan.choices import candidates
    from zeropp.plan.ranking import best_config, rank

    model, base = _model(args)
    hw = _hardware(args)
    work = _workload(args, model, base)
    choices = candidates(hw.ranks_per_node, hw.world, all_bits=args.all_bits, offload=not args.no_offload)
    rows = rank(model, hw, work, choices)
    link = f"{args.inter_node_gbps:g} Gbit/s" if args.inter_node_gbps else "as profiled"
    print(f"zeropp plan: {model.name} ({model.params / 1e9:.3g}B parameters, {len(model.units)} units) on "
          f"{hw.nodes} nodes x {hw.ranks_per_node} ranks; inter-node {link}; {hw.flops / 1e12:.3g} TFLOP/s and "
          f"{args.memory_gib:g} GiB per rank; micro-batch {work.micro_batch} x {work.seq_len} tokens, "
          f"{work.grad_accum} micro-step(s), {'bf16' if work.bf16 else 'fp32'}; speeds: {hw.source}\n")
    print(table(rows, args.top))
    best = best_config(rows, work, hw.ranks_per_node, model, hw.world, base)
    if best is None:
        print("\nnothing fits: more ranks, a smaller micro-batch, --checkpointing, or offload")
    else:
        print(f"\nbest: {rows[0].choice.label}; config JSON:")
        print(json.dumps(best, indent=2))
    if args.json:
        out = {"rows": [{"configuration": r.choice.label, "step_s": r.time.step_s, "tokens_per_s": r.tokens_per_s,
                         "model_state_bytes": r.memory.states, "need_bytes": r.memory.need, "fits": r.fits,
                         "volumes": r.time.volumes} for r in rows], "best_config": best}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from zeropp.plan import calibrate

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.cluster:
        profile = calibrate.calibrate_torchrun(args.out, args.inter_node_gbps)
    elif args.cluster:
        bws = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
        profile = calibrate.calibrate_cluster(_int_option(args.nodes, "--nodes", 2),
                                              _int_option(args.ranks_per_node, "--ranks-per-node", 2), bws, args.out)
    else:
        profile = calibrate.calibrate_loopback(args.out)
    if profile is not None:
        print(f"zeropp plan: wrote {args.out}: {profile.step_flops / 1e9:.2f} GFLOP/s per rank (probe step), "
              f"links: " + ", ".join(link.label for link in profile.inter))
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return run_calibrate(args) if args.calibrate else run_plan(args)
    except PlanError as err:
        print(f"zeropp plan: {err}", file=sys.stderr)
        return 2
