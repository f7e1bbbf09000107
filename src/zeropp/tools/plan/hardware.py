"""The cluster a plan is for: its layout, compute rate, link rates and latencies, and the host-side rates
(quantizer, optimizer, reductions), from a calibration profile or from the command line plus defaults."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from zeropp.tools.plan.profile import Fit, PlanError, Profile

#: Assumptions for an accelerator cluster when no profile measured them (per GPU unless said otherwise). The
#: quantizer, reductions and copies are memory-bound kernels, rated here for ~900 GB/s of HBM (a V100; an A100 or
#: H100 is 2-4x faster, and a ``--gpu`` preset scales them by its HBM bandwidth, ``presets.py``): quantizing reads
#: 2 bytes and writes 0.5-1 per element; the optimizer is a fused Adam moving ~28 bytes per element; host Adam is
#: DeepSpeed's CPU Adam order of magnitude with the node's cores shared by its ranks.
GPU_DEFAULTS = {
    "quantize_per_s": 250e9,  # elements/s
    "dequantize_per_s": 250e9,
    "optimizer_per_s": 30e9,  # elements/s, fused Adam on HBM
    "offload_optimizer_per_s": 0.25e9,  # elements/s per rank, host Adam
    "reduce_sum_per_s": 150e9,  # received elements/s (16-bit in, fp32 accumulate)
    "copy_bytes_per_s": 600e9,
    "host_link_gbps": 100.0,  # PCIe gen3 x16, one direction (~12 GB/s)
    "inter_latency_s": 10e-6,  # per message hop across nodes
    "intra_latency_s": 3e-6,
    "wire_efficiency": 0.85,  # what NCCL's collectives get of a link's nominal rate
}


@dataclass(frozen=True)
class Hardware:
    """Everything the time model reads about the machines. Rates are per rank unless named per node."""

    nodes: int
    ranks_per_node: int
    flops: float  # achieved FLOP/s of one rank on the model's forward and backward
    memory_bytes: float  # accelerator memory per rank (the "fits" limit)
    inter_bytes_per_s: Optional[float]  # nominal, per node, one direction; None: unshaped (profile host fits)
    intra_bytes_per_s: Optional[float]  # per rank inside a node; None: intra collectives cost host time only
    quantize_per_s: dict[int, float]
    dequantize_per_s: dict[int, float]
    optimizer_per_s: float
    offload_optimizer_per_s: float
    reduce_sum_per_s: float
    copy_bytes_per_s: float
    host_link_bytes_per_s: float
    inter_latency_s: float = GPU_DEFAULTS["inter_latency_s"]
    intra_latency_s: float = GPU_DEFAULTS["intra_latency_s"]
    comm_uses_compute: bool = False  # collectives' host time competes with compute (CPU ranks)
    wire_efficiency: dict[str, float] = field(default_factory=dict)  # pattern -> achieved / nominal
    host_fits: dict[str, Fit] = field(default_factory=dict)  # pattern -> host time of a collective (profile)
    shaped_fits: dict[str, Fit] = field(default_factory=dict)  # pattern -> fit on the shaped link (its alpha)
    device_is_host: bool = False  # CPU ranks: offload moves nothing over a host link
    source: str = "command line"
    # qgZ's fused steps (input elements/s by bits); empty: dequantize + sum + quantize at the separate rates
    qgz_sum_requantize_per_s: dict[int, float] = field(default_factory=dict)
    qgz_sum_per_s: dict[int, float] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def efficiency(self, pattern: str) -> float:
        return self.wire_efficiency.get(pattern, GPU_DEFAULTS["wire_efficiency"])

    def with_memory(self, memory_bytes: float) -> "Hardware":
        return replace(self, memory_bytes=memory_bytes)


def gpu_cluster(nodes: int, gpus_per_node: int, gpu_tflops: float, inter_gbps: float, intra_gbps: float,
                memory_gib: float, host_link_gbps: Optional[float] = None,
                rates: Optional[Mapping[str, float]] = None, source: str = "command line") -> Hardware:
    """An accelerator cluster from its nominal numbers (``GPU_DEFAULTS`` for the rest). ``rates`` replaces
    ``GPU_DEFAULTS`` entries (a ``--gpu`` preset's memory-bound rates, ``presets.py``); ``source`` names where the
    numbers came from (printed with the plan)."""
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--gpu-tflops", gpu_tflops),
                        ("--inter-node-gbps", inter_gbps), ("--intra-node-gbps", intra_gbps),
                        ("--memory-gib", memory_gib)):
        if value is None or not value > 0:
            raise PlanError(f"{name}: must be a positive number, got {value}")
    d = {**GPU_DEFAULTS, **(rates or {})}
    return Hardware(
        nodes=nodes, ranks_per_node=gpus_per_node, flops=gpu_tflops * 1e12, memory_bytes=memory_gib * 2**30,
        inter_bytes_per_s=inter_gbps * 1e9 / 8, intra_bytes_per_s=intra_gbps * 1e9 / 8,
        quantize_per_s={8: d["quantize_per_s"], 4: d["quantize_per_s"]},
        dequantize_per_s={8: d["dequantize_per_s"], 4: d["dequantize_per_s"]},
        qgz_sum_requantize_per_s={8: d["dequantize_per_s"], 4: d["dequantize_per_s"]},  # one fused pass each
        qgz_sum_per_s={8: d["dequantize_per_s"], 4: d["dequantize_per_s"]},
        optimizer_per_s=d["optimizer_per_s"], offload_optimizer_per_s=d["offload_optimizer_per_s"],
        reduce_sum_per_s=d["reduce_sum_per_s"], copy_bytes_per_s=d["copy_bytes_per_s"],
        host_link_bytes_per_s=(host_link_gbps or d["host_link_gbps"]) * 1e9 / 8, source=source)


def streaming_efficiency(fits: dict[str, Fit]) -> dict[str, float]:
    """Note [streaming link efficiency]: the wire efficiency every pattern is timed at on a shaped link.

    The calibration probes each pattern alone, one synchronous call per sample. For the groups of one rank per
    node (qgZ's second hop, the first hop of a two-hop gather) such a call gets a share of the link that depends
    on how the groups' sends happen to take turns: 0.50-0.96 of the nominal rate from one calibration to the
    next on the emulated 2 x 2 cluster, where one pair alone gets exactly half (docs/benchmarks.md, "Why the
    inter-node probes scatter"). The engine keeps several collectives of both groups in flight and the link
    busy, and the world all-gather, whose probe also keeps it busy, is stable at 0.90-0.96. So every pattern is
    timed at the world all-gather's efficiency when the profile measured it (the per-pattern values stay in the
    profile, as measured). Replaying the three recorded two-hop plan_check runs: worst |error| 35.1% -> 14.7%,
    59.6% -> 17.2% and 38.1% -> 38.1% (an unlimited-link row, which no efficiency enters).
    """
    measured = {k: f.wire_efficiency for k, f in fits.items() if f.wire_efficiency}
    link = measured.get("all_gather")
    return {k: link for k in measured} if link else measured


def from_profile(profile: Profile, nodes: int, ranks_per_node: int, memory_gib: float,
                 inter_gbps: Optional[float] = None, link_label: Optional[str] = None,
                 gpu_tflops: Optional[float] = None, intra_gbps: Optional[float] = None) -> Hardware:
    """The machines a profile measured. ``inter_gbps`` picks the inter-node fits measured nearest that rate
    (``link_label`` names one setting); None uses the unshaped setting, as the profile measured it.

    On CPU ranks (``profile.device == "cpu"``) compute is the measured step rate and every collective costs
    host time (fitted on the unshaped link); a shaped link adds wire time at the measured efficiency.
    """
    inter = profile.inter_for(inter_gbps, link_label)
    unshaped = profile.unshaped() or inter
    if inter_gbps is None and inter.gbps:
        inter_gbps = inter.gbps
    shaped = bool(inter_gbps) and bool(inter.gbps)
    host_fits = dict(unshaped.fits) if profile.comm_uses_compute else {}
    host_fits.update({f"intra_{k}": v for k, v in profile.intra.items()} if profile.comm_uses_compute else {})
    eff = streaming_efficiency(inter.fits) if shaped else {}
    flops = profile.step_flops if gpu_tflops is None else gpu_tflops * 1e12
    q = {int(b): r for b, r in profile.quantize_per_s.items()}
    dq = {int(b): r for b, r in profile.dequantize_per_s.items()}
    if memory_gib is None or not memory_gib > 0:
        raise PlanError(f"--memory-gib: must be a positive number, got {memory_gib}")
    return Hardware(
        nodes=nodes, ranks_per_node=ranks_per_node, flops=flops, memory_bytes=memory_gib * 2**30,
        inter_bytes_per_s=inter_gbps * 1e9 / 8 if shaped else None,
        intra_bytes_per_s=intra_gbps * 1e9 / 8 if intra_gbps and not profile.comm_uses_compute else None,
        quantize_per_s=q, dequantize_per_s=dq, optimizer_per_s=profile.optimizer_per_s,
        offload_optimizer_per_s=profile.optimizer_per_s, reduce_sum_per_s=profile.reduce_sum_per_s,
        copy_bytes_per_s=profile.copy_bytes_per_s,
        host_link_bytes_per_s=GPU_DEFAULTS["host_link_gbps"] * 1e9 / 8,
        inter_latency_s=0.0, intra_latency_s=0.0, comm_uses_compute=profile.comm_uses_compute,
        wire_efficiency=eff, host_fits=host_fits, shaped_fits=dict(inter.fits) if shaped else {},
        device_is_host=profile.device == "cpu", source=f"profile ({profile.source}, link {inter.label})",
        qgz_sum_requantize_per_s={int(b): r for b, r in profile.qgz_sum_requantize_per_s.items()},
        qgz_sum_per_s={int(b): r for b, r in profile.qgz_sum_per_s.items()})
