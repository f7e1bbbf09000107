"""Named accelerators and fabrics for ``zeropp plan --gpu NAME --fabric NAME``: datasheet numbers turned into the
hardware options, by one rule each, so that "is ZeRO++ worth it on my cluster?" needs no rates typed in.

Every value a preset fills is overridable: an explicit ``--gpu-tflops``, ``--memory-gib``, ``--intra-node-gbps``
or ``--inter-node-gbps`` wins (``cli._resolved``). The table is in docs/plan.md, "Presets".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeropp.tools.plan.hardware import GPU_DEFAULTS
from zeropp.tools.plan.profile import PlanError

#: Achieved over peak on the model's matmuls: ONE fraction for every part, the middle of the 40-50% of the dense
#: (no-sparsity) 16-bit datasheet peak that GPT training typically gets (docs/plan.md, "Use").
ACHIEVED_FRACTION = 0.45
#: The HBM bandwidth GPU_DEFAULTS' memory-bound kernel rates are rated for (a V100's 900 GB/s): a preset scales
#: them by its own bandwidth over this, since quantizing, summing, copying and Adam stream memory.
REFERENCE_HBM_GBS = 900.0
#: The GPU_DEFAULTS rates that are HBM-bound (host Adam, latencies and the wire efficiency are not).
MEMORY_BOUND = ("quantize_per_s", "dequantize_per_s", "optimizer_per_s", "reduce_sum_per_s", "copy_bytes_per_s")
#: Host link (offload's transfers) per GPU, Gbit/s one direction, by PCIe generation of an x16 slot: GPU_DEFAULTS'
#: gen3 figure (100, ~80% of the 126 nominal) doubled per generation, as the lane rate doubles.
PCIE_GBPS = {3: 100.0, 4: 200.0, 5: 400.0}


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator as its datasheet gives it; the plan's numbers are derived (properties)."""

    name: str
    part: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak, without 2:4 sparsity
    memory_gib: float  # the datasheet capacity; these parts' "GB" are binary-sized, so read as GiB
    hbm_gbs: float  # memory bandwidth, GB/s
    intra_gbps: float  # per GPU inside a node, Gbit/s one direction (NVLink / Infinity Fabric / PCIe)
    pcie_gen: int  # the host link
    source: str

    @property
    def tflops(self) -> float:
        """The achieved TFLOP/s the plan uses: ``ACHIEVED_FRACTION`` of the dense peak."""
        return self.peak_tflops * ACHIEVED_FRACTION

    @property
    def host_link_gbps(self) -> float:
        return PCIE_GBPS[self.pcie_gen]

    @property
    def kernel_scale(self) -> float:
        return self.hbm_gbs / REFERENCE_HBM_GBS

    def kernel_rates(self) -> dict[str, float]:
        """GPU_DEFAULTS' memory-bound rates scaled by this part's memory bandwidth."""
        return {k: GPU_DEFAULTS[k] * self.kernel_scale for k in MEMORY_BOUND}


# Gbit/s one direction = GB/s x 8; NVLink's datasheet figure is both directions, so half of it is one direction.
_GPUS = (
    # V100 SXM2 datasheet: 125 TFLOPS fp16 tensor (no bf16 units), 16 or 32 GB HBM2 at 900 GB/s,
    # NVLink 2 at 300 GB/s (6 links x 25 GB/s each way = 150 GB/s one direction), PCIe gen3.
    GpuPreset("v100-16gb", "NVIDIA V100 SXM2 16GB", 125.0, 16.0, 900.0, 1200.0, 3,
              "V100 datasheet (SXM2): 125 fp16 tensor, HBM2 900 GB/s, NVLink 2 300 GB/s"),
    GpuPreset("v100-32gb", "NVIDIA V100 SXM2 32GB", 125.0, 32.0, 900.0, 1200.0, 3,
              "V100 datasheet (SXM2): 125 fp16 tensor, HBM2 900 GB/s, NVLink 2 300 GB/s"),
    # A100 SXM4 datasheet: 312 TFLOPS bf16 dense (624 with sparsity); 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at
    # 2,039 GB/s; NVLink 3 at 600 GB/s (300 one direction); PCIe gen4.
    GpuPreset("a100-40gb", "NVIDIA A100 SXM4 40GB", 312.0, 40.0, 1555.0, 2400.0, 4,
              "A100 datasheet (SXM4): 312 bf16, HBM2 1,555 GB/s, NVLink 3 600 GB/s"),
    GpuPreset("a100-80gb", "NVIDIA A100 SXM4 80GB", 312.0, 80.0, 2039.0, 2400.0, 4,
              "A100 datasheet (SXM4): 312 bf16, HBM2e 2,039 GB/s, NVLink 3 600 GB/s"),
    # H100 SXM5 datasheet: 1,979 TFLOPS bf16 with sparsity = 989.4 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 4 at
    # 900 GB/s (450 one direction); PCIe gen5. H200 SXM: the same compute and NVLink, 141 GB HBM3e at 4.8 TB/s.
    GpuPreset("h100", "NVIDIA H100 SXM5 80GB", 989.4, 80.0, 3350.0, 3600.0, 5,
              "H100 datasheet (SXM5): 989.4 bf16 dense, HBM3 3.35 TB/s, NVLink 4 900 GB/s"),
    GpuPreset("h200", "NVIDIA H200 SXM 141GB", 989.4, 141.0, 4800.0, 3600.0, 5,
              "H200 datasheet (SXM): 989.4 bf16 dense, HBM3e 4.8 TB/s, NVLink 4 900 GB/s"),
    # L40S datasheet: 362.05 TFLOPS bf16 dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s, no NVLink: GPUs
    # talk over PCIe gen4 x16 (64 GB/s both directions, 32 one direction, every GPU on its own x16 assumed).
    GpuPreset("l40s", "NVIDIA L40S (PCIe)", 362.05, 48.0, 864.0, 256.0, 4,
              "L40S datasheet: 362.05 bf16 dense, GDDR6 864 GB/s, PCIe gen4 x16 64 GB/s, no NVLink"),
    # MI300X datasheet: 1,307.4 TFLOPS bf16 dense (2,614.9 with sparsity), 192 GB HBM3 at 5.3 TB/s; on an 8-GPU
    # platform 7 Infinity Fabric links of 128 GB/s (both directions) to the peers: 896 GB/s, 448 one direction
    # (a mesh: one peer pair gets one link, 64 GB/s); PCIe gen5.
    GpuPreset("mi300x", "AMD Instinct MI300X (OAM)", 1307.4, 192.0, 5300.0, 3584.0, 5,
              "MI300X datasheet: 1,307.4 bf16 dense, HBM3 5.3 TB/s, 7 x 128 GB/s Infinity Fabric"),
)
GPUS: dict[str, GpuPreset] = {p.name: p for p in _GPUS}


@dataclass(frozen=True)
class FabricPreset:
    """An inter-node fabric: a port rate and how many ports a node has (``--inter-node-gbps`` is per node)."""

    name: str
    port_gbps: float
    ports_per_node: Optional[int]  # None: one port per GPU (a rail-optimized DGX/HGX node)
    assumes: str

    def node_gbps(self, gpus_per_node: int) -> float:
        """Each node's link to the others, Gbit/s one direction: what ``--inter-node-gbps`` means."""
        return self.port_gbps * (self.ports_per_node or gpus_per_node)


FABRICS: dict[str, FabricPreset] = {f.name: f for f in (
    FabricPreset("ib-ndr", 400.0, None, "InfiniBand NDR, one 400 Gbit/s port per GPU (DGX/HGX H100: 8 per node)"),
    FabricPreset("ib-ndr-x1", 400.0, 1, "InfiniBand NDR, one 400 Gbit/s port per node"),
    FabricPreset("ib-hdr", 200.0, None, "InfiniBand HDR, one 200 Gbit/s port per GPU (DGX A100: 8 per node)"),
    FabricPreset("ib-hdr-x1", 200.0, 1, "InfiniBand HDR, one 200 Gbit/s port per node"),
    FabricPreset("roce-100g", 100.0, 1, "RoCE v2, one 100 GbE port per node"),
    # TCP sockets get less of the wire than RDMA; the plan times every fabric at GPU_DEFAULTS' 0.85
    FabricPreset("eth-100g", 100.0, 1, "Ethernet (TCP), one 100 GbE port per node"),
    FabricPreset("eth-25g", 25.0, 1, "Ethernet (TCP), one 25 GbE port per node"),
    FabricPreset("eth-10g", 10.0, 1, "Ethernet (TCP), one 10 GbE port per node"),
)}


def gpu_preset(name: str) -> GpuPreset:
    """The ``--gpu`` preset called ``name`` (any case); a PlanError naming it and the known names otherwise."""
    found = GPUS.get(name.strip().lower())
    if found is None:
        raise PlanError(f"--gpu {name}: unknown accelerator; known: {', '.join(GPUS)}")
    return found


def fabric_preset(name: str) -> FabricPreset:
    """The ``--fabric`` preset called ``name`` (any case); a PlanError naming it and the known names otherwise."""
    found = FABRICS.get(name.strip().lower())
    if found is None:
        raise PlanError(f"--fabric {name}: unknown fabric; known: {', '.join(FABRICS)}")
    return found


def fabric_help() -> str:
    """One line per --help: each fabric and its rate."""
    return ", ".join(f"{f.name} ({f.port_gbps:g}/{'GPU' if f.ports_per_node is None else 'node'})"
                     for f in FABRICS.values())
