"""The benchmarked systems by name (no torch import: the CLI's help text reads this)."""
from __future__ import annotations

#: name -> (family, label for tables)
SYSTEMS: dict[str, tuple[str, str]] = {
    "ddp": ("torch", "torch DDP"),
    "fsdp2": ("torch", "FSDP2"),
    "fsdp2_hpz": ("torch", "FSDP2 reshard_after_forward=R"),
    "ds_zero3": ("deepspeed", "DeepSpeed ZeRO-3"),
    "ds_zero3_hpz": ("deepspeed", "DeepSpeed ZeRO-3 + hpZ"),
    "ds_zero3_prefetch": ("deepspeed", "DeepSpeed ZeRO-3, prefetch on (keeps params fwd->bwd)"),
    "zeropp_zero3": ("zeropp", "zeropp ZeRO-3"),
    "zeropp_qwz": ("zeropp", "zeropp + qwZ"),
    "zeropp_hpz": ("zeropp", "zeropp + hpZ"),
    "zeropp_qgz": ("zeropp", "zeropp + qgZ"),
    "zeropp_all": ("zeropp", "zeropp ZeRO++ (qwZ+hpZ+qgZ)"),
    "zeropp_all_w4": ("zeropp", "zeropp ZeRO++, 4-bit qwZ (blocks of 256)"),
}
#: Rows that cannot run here, with the reason shown in the table.
NOT_RUNNABLE: dict[str, str] = {
    "DeepSpeed ZeRO++ qwZ / qgZ": "not run: DeepSpeed's quantizer kernels are CUDA-only "
                                  "(\"This op had not been implemented on CPU backend.\")",
}
ZEROPP_SWITCHES = {
    "zeropp_zero3": (False, False, False),
    "zeropp_qwz": (True, False, False),
    "zeropp_hpz": (False, True, False),
    "zeropp_qgz": (False, False, True),
    "zeropp_all": (True, True, True),
}
#: ZeRO++ variants: the ``zero_optimization`` keys they set on top of ``zeropp_all``. 4-bit weight gathers halve the
#: forward's inter-node bytes, the one transfer a slow link cannot hide behind compute (docs/benchmarks.md, "4-bit
#: weight gathers"); blocks of 256 keep their loss next to int8's (bench/convergence_loco.py --only w4_b256).
ZEROPP_VARIANTS: dict[str, dict[str, int]] = {
    "zeropp_all_w4": {"zero_quantized_weights_bits": 4, "quantization_block_size": 256},
}
