"""``zeropp plan``: the command line over the cost model (``zeropp plan --help``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from zeropp.tools.plan.profile import PlanError

DESCRIPTION = (
    "Predict, for a model and a cluster, the step time, tokens/s and memory per rank of ZeRO stages 0-3 with and "
    "without each ZeRO++ technique and optimizer offload; print them ranked and the config JSON of the fastest "
    "one that fits. --calibrate measures this machine (or, with --cluster, the emulated cluster of `zeropp "
    "bench`; under torchrun, the real one) and writes a profile that --profile reads. See docs/plan.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zeropp.tools.plan.presets import ACHIEVED_FRACTION, GPUS, fabric_help  # pure Python: --help stays quick

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
    p.add_argument("--gpu", default=None, metavar="NAME", help="accelerator preset: " + ", ".join(GPUS) + "; fills "
                   f"--gpu-tflops ({ACHIEVED_FRACTION * 100:.0f}%% of the dense 16-bit peak), --memory-gib, "
                   "--intra-node-gbps, the host link and the memory-bound kernel rates (an explicit option wins; "
                   "with --profile the measured rates win; see docs/plan.md)")
    p.add_argument("--fabric", default=None, metavar="NAME", help="inter-node preset (Gbit/s of a port, one port "
                   "per GPU or per node): " + fabric_help() + "; fills --inter-node-gbps (an explicit one wins)")
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
    from zeropp.config.policy import default_reduce_bucket_size
    from zeropp.tools.plan.schedule import Workload

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
    from zeropp.tools.plan.model import gpt_of_size, load_model, parse_params

    if not args.model:
        raise PlanError("--model: required (a parameter count, an HF config.json or a DeepSpeed config)")
    model, base = load_model(args.model)
    if base is not None:
        from zeropp.config.loader import ConfigError, load_config

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


def _resolved(args: argparse.Namespace, gpus_per_node: int) -> tuple[Any, dict[str, Optional[float]]]:
    """The ``--gpu`` preset (None without one) and the hardware options, each the explicit option if given, else
    the ``--gpu`` / ``--fabric`` preset's value, else None."""
    from zeropp.tools.plan.presets import fabric_preset, gpu_preset

    gpu = gpu_preset(args.gpu) if args.gpu else None
    fabric = fabric_preset(args.fabric) if args.fabric else None  # a bad name errors even when overridden

    def pick(given: Optional[float], preset: Optional[float]) -> Optional[float]:
        return given if given is not None else preset

    return gpu, {
        "--gpu-tflops": pick(args.gpu_tflops, gpu.tflops if gpu else None),
        "--inter-node-gbps": pick(args.inter_node_gbps, fabric.node_gbps(gpus_per_node) if fabric else None),
        "--intra-node-gbps": pick(args.intra_node_gbps, gpu.intra_gbps if gpu else None),
        "--memory-gib": pick(args.memory_gib, gpu.memory_gib if gpu else None)}


def _profiled(args: argparse.Namespace, gpu: Any, nodes: int, gpn: int, v: dict[str, Optional[float]]) -> Any:
    """Hardware from a measured profile: measured rates win over a ``--gpu`` preset, which then fills only what a
    profile does not record (memory, the intra-node and host links); an explicit option still wins over both."""
    from dataclasses import replace

    from zeropp.tools.plan.hardware import from_profile
    from zeropp.tools.plan.profile import load_profile

    profile = load_profile(args.profile)
    if gpu is not None and profile.device == "cpu":
        raise PlanError(f"--gpu {args.gpu}: the profile {args.profile} measured CPU ranks, which a GPU preset does "
                        "not describe; drop --gpu (give --memory-gib) or calibrate on the GPUs")
    hw = from_profile(profile, nodes, gpn, v["--memory-gib"], v["--inter-node-gbps"], None, args.gpu_tflops,
                      v["--intra-node-gbps"])
    if gpu is None:
        return hw
    return replace(hw, host_link_bytes_per_s=gpu.host_link_gbps * 1e9 / 8,
                   source=f"{hw.source}; memory and links of preset {gpu.name}")


def _hardware(args: argparse.Namespace) -> Any:
    from zeropp.tools.plan.hardware import gpu_cluster

    nodes = _int_option(args.nodes, "--nodes", 0) if args.nodes is not None else None
    gpn = _int_option(args.gpus_per_node, "--gpus-per-node", 0) if args.gpus_per_node is not None else None
    if nodes is None or gpn is None:
        raise PlanError(("--nodes" if nodes is None else "--gpus-per-node") + ": required")
    gpu, v = _resolved(args, gpn)
    if v["--memory-gib"] is None:
        raise PlanError("--memory-gib: required (accelerator memory per rank), or --gpu NAME")
    if args.profile:
        return _profiled(args, gpu, nodes, gpn, v)
    if gpu is not None and args.fp32 and args.gpu_tflops is None:
        # the presets' rate is the 16-bit tensor-core one; fp32 runs at a fraction that differs by part
        raise PlanError(f"--fp32: --gpu {args.gpu}'s rate is for bf16/fp16 matmuls; give --gpu-tflops for fp32")
    for name, value in v.items():
        if value is None:
            hint = " (or --fabric NAME)" if name == "--inter-node-gbps" else " (or --gpu NAME)"
            raise PlanError(f"{name}: required without --profile" + hint)
    if gpu is None:
        return gpu_cluster(nodes, gpn, v["--gpu-tflops"], v["--inter-node-gbps"], v["--intra-node-gbps"],
                           v["--memory-gib"])
    return gpu_cluster(nodes, gpn, v["--gpu-tflops"], v["--inter-node-gbps"], v["--intra-node-gbps"],
                       v["--memory-gib"], gpu.host_link_gbps, gpu.kernel_rates(),
                       f"preset {gpu.name} ({gpu.part}; memory-bound kernels x{gpu.kernel_scale:.2f} GPU_DEFAULTS, "
                       f"PCIe gen{gpu.pcie_gen} host link)")


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


def _link(args: argparse.Namespace, hw: Any) -> str:
    """The inter-node link as the plan times it, with the --fabric preset's assumption when that set it."""
    if not hw.inter_bytes_per_s:
        return "as profiled"
    link = f"{hw.inter_bytes_per_s * 8 / 1e9:g} Gbit/s"
    if args.fabric and args.inter_node_gbps is None:
        from zeropp.tools.plan.presets import fabric_preset

        link += f" ({fabric_preset(args.fabric).assumes})"
    return link


def run_plan(args: argparse.Namespace) -> int:
    from zeropp.tools.plan.choices import candidates
    from zeropp.tools.plan.ranking import best_config, rank

    model, base = _model(args)
    hw = _hardware(args)
    work = _workload(args, model, base)
    choices = candidates(hw.ranks_per_node, hw.world, all_bits=args.all_bits, offload=not args.no_offload)
    rows = rank(model, hw, work, choices)
    print(f"zeropp plan: {model.name} ({model.params / 1e9:.3g}B parameters, {len(model.units)} units) on "
          f"{hw.nodes} nodes x {hw.ranks_per_node} ranks; inter-node {_link(args, hw)}; {hw.flops / 1e12:.3g} "
          f"TFLOP/s and {hw.memory_bytes / 2**30:g} GiB per rank; micro-batch {work.micro_batch} x "
          f"{work.seq_len} tokens, {work.grad_accum} micro-step(s), {'bf16' if work.bf16 else 'fp32'}; "
          f"speeds: {hw.source}\n")
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
    from zeropp.tools.plan import calibrate

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
