"""The configurations a plan compares: ZeRO stage, the ZeRO++ techniques with their bit widths and hpZ group
size, and optimizer offload; each one written back as the config JSON that runs it."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Choice:
    """One configuration. ``qwz_bits``/``qgz_bits`` 0 = off; ``hpz`` 1 = off (else the group size)."""

    stage: int
    qwz_bits: int = 0
    hpz: int = 1
    qgz_bits: int = 0
    offload: bool = False  # optimizer offload to the host (ZeRO-Offload)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0-3, got {self.stage}")
        if self.stage < 3 and (self.qwz_bits or self.hpz > 1 or self.qgz_bits):
            raise ValueError("qwZ, hpZ and qgZ are stage-3 techniques")
        if self.qwz_bits not in (0, 4, 8) or self.qgz_bits not in (0, 4, 8):
            raise ValueError("qwZ and qgZ bit widths are 4 or 8 (0 = off)")

    @property
    def label(self) -> str:
        if self.stage < 3:
            base = f"ZeRO-{self.stage}" if self.stage else "stage 0 (DDP-like)"
        else:
            parts = ([f"qwZ{self.qwz_bits}"] if self.qwz_bits else []) + ([f"hpZ{self.hpz}"] if self.hpz > 1 else []) \
                + ([f"qgZ{self.qgz_bits}"] if self.qgz_bits else [])
            base = "ZeRO-3" + (" + " + " + ".join(parts) if parts else "")
        return base + (" + offload" if self.offload else "")

    @property
    def techniques(self) -> int:
        """How many of qwZ, hpZ, qgZ are on (quantization trades accuracy; each is one more thing to run)."""
        return bool(self.qwz_bits) + (self.hpz > 1) + bool(self.qgz_bits)

    @property
    def is_zeropp(self) -> bool:
        return bool(self.qwz_bits or self.hpz > 1 or self.qgz_bits)


def candidates(ranks_per_node: int, world: int, all_bits: bool = False, offload: bool = True,
               hpz_sizes: Optional[list[int]] = None) -> list[Choice]:
    """Stages 0-2; ZeRO-3 with each subset of qwZ (int8), hpZ (group = a node) and qgZ (int4); optionally the
    other bit widths and hpZ group sizes; optimizer offload for stages 2 and 3."""
    sizes = hpz_sizes if hpz_sizes is not None else [ranks_per_node] if 1 < ranks_per_node < world else []
    out = [Choice(0), Choice(1), Choice(2)]
    qwz_opts = [0, 8] + ([4] if all_bits else [])
    qgz_opts = [0, 4] + ([8] if all_bits else [])
    for qwz in qwz_opts:
        for hpz in [1] + [s for s in sizes if 1 < s <= world and world % s == 0]:
            for qgz in qgz_opts:
                if qgz and world == 1:
                    continue
                out.append(Choice(3, qwz, hpz, qgz))
    if offload:
        out += [Choice(2, offload=True), Choice(3, offload=True)]
        if sizes:
            out.append(Choice(3, 8, sizes[0], 4, offload=True))
    seen: set[Choice] = set()
    return [c for c in out if not (c in seen or seen.add(c))]  # type: ignore[func-returns-value]


def choice_of(cfg: Any) -> Choice:
    """The configuration a validated ``ZeroppConfig`` runs."""
    z = cfg.zero_optimization
    off = z.offload_optimizer is not None and z.offload_optimizer.device != "none"
    if z.stage < 3:
        return Choice(z.stage, offload=off)
    return Choice(3, z.zero_quantized_weights_bits if z.zero_quantized_weights else 0, z.zero_hpz_partition_size,
                  z.zero_quantized_gradients_bits if z.zero_quantized_gradients else 0, off)


def config_json(choice: Choice, micro_batch: int, grad_accum: int, ranks_per_node: int,
                base: Optional[dict[str, Any]] = None, bucket: Optional[int] = None,
                bf16: bool = True, prefetch: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """The DeepSpeed-style config that runs ``choice``: ``base`` (the user's config, if given) with its
    ``zero_optimization`` switched to the choice and the batch and node layout set. ``prefetch``: stage 3's
    ``(stage3_prefetch_bucket_size, stage3_max_live_parameters)`` to set where ``base`` sets neither."""
    out = copy.deepcopy(base) if base else {}
    out.pop("train_batch_size", None)  # micro-batch x accumulation x world says it
    out["train_micro_batch_size_per_gpu"] = micro_batch
    out["gradient_accumulation_steps"] = grad_accum
    if not base or not (out.get("fp16", {}) or {}).get("enabled"):
        out["bf16"] = {"enabled": bf16}
    zero = dict(out.get("zero_optimization") or {})
    for key in ("zero_quantized_weights", "zero_quantized_weights_bits", "zero_hpz_partition_size",
                "zero_quantized_gradients", "zero_quantized_gradients_bits", "offload_optimizer"):
        zero.pop(key, None)
    zero["stage"] = choice.stage
    if bucket is not None:
        zero["reduce_bucket_size"] = bucket
    if choice.stage == 3:
        zero["zero_quantized_weights"] = bool(choice.qwz_bits)
        if choice.qwz_bits:
            zero["zero_quantized_weights_bits"] = choice.qwz_bits
        zero["zero_hpz_partition_size"] = choice.hpz
        zero["zero_quantized_gradients"] = bool(choice.qgz_bits)
        if choice.qgz_bits:
            zero["zero_quantized_gradients_bits"] = choice.qgz_bits
    if choice.stage == 3 and prefetch is not None and not {"stage3_prefetch_bucket_size",
                                                            "stage3_max_live_parameters"} & zero.keys():
        zero["stage3_prefetch_bucket_size"], zero["stage3_max_live_parameters"] = prefetch
    if choice.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    out["zero_optimization"] = zero
    topo = dict(out.get("topology") or {})
    topo["ranks_per_node"] = ranks_per_node
    out["topology"] = topo
    return out

