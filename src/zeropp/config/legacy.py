"""Config forms that DeepSpeed still reads but that are not in zeropp's schema, rewritten before validation.

Public configs are written against many DeepSpeed versions and often carry keys nobody reads. Before the
schema sees a config, this module rewrites (with a warning) or sets aside what DeepSpeed itself accepts:

* DeepSpeed's deprecated spellings, read as DeepSpeed reads them: ``"zero_optimization": true`` (stage 1,
  with ``allgather_size``), ``bfloat16`` (now ``bf16``), and ``cpu_offload`` / ``cpu_offload_param`` /
  ``cpu_offload_use_pin_memory`` (now the ``offload_optimizer`` / ``offload_param`` sections);
* ``zero_optimization.aio``, where Hugging Face's docs print it (DeepSpeed rejects it there), as ``aio``;
* top-level keys DeepSpeed does not read at all (``monitor_config``, ``comms_config``,
  ``cuda_visible_devices``: they look like settings but change nothing in DeepSpeed either), and
  ``_comment``-style keys (JSON has no comments);
* DeepSpeed features zeropp does not have (the profiler, monitors, curriculum learning, ...): a section that
  is switched off loads; one that is switched on is "not supported yet", naming it.

Everything else, unknown keys and typos included, is left for the schema to reject with its JSON path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from zeropp.config.schema import as_flag

# Top-level keys that DeepSpeed's config reader never looks at (so they have no effect there either).
IGNORED_KEYS = {
    "monitor_config": "DeepSpeed reads the top-level tensorboard, wandb, csv_monitor and comet sections",
    "comms_config": "DeepSpeed reads comms_logger",
    "cuda_visible_devices": "devices are chosen by the launcher: CUDA_VISIBLE_DEVICES, torchrun",
}


def _enabled_off(value: Any) -> bool:
    return isinstance(value, Mapping) and as_flag(value.get("enabled", False)) is False


def _falsy(value: Any) -> bool:
    return value is None or as_flag(value) is False


# DeepSpeed features zeropp lacks: key -> (what it is, "is it off?"). Off sections load; on ones are refused.
NOT_IMPLEMENTED_FEATURES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "flops_profiler": ("DeepSpeed's FLOPs profiler", _enabled_off),
    "tensorboard": ("the TensorBoard monitor", _enabled_off),
    "wandb": ("the Weights & Biases monitor", _enabled_off),
    "csv_monitor": ("the CSV monitor", _enabled_off),
    "comet": ("the Comet monitor", _enabled_off),
    "comms_logger": ("DeepSpeed's communication logger; zeropp's engine.comm_report() counts every byte",
                     _enabled_off),
    "amp": ("NVIDIA Apex AMP; use bf16 or fp16", _enabled_off),
    "curriculum_learning": ("curriculum learning", _enabled_off),
    "data_efficiency": ("DeepSpeed's data efficiency library", _enabled_off),
    "progressive_layer_drop": ("progressive layer dropping", _enabled_off),
    "eigenvalue": ("eigenvalue computation", _enabled_off),
    "elasticity": ("DeepSpeed's elastic batch sizes", _enabled_off),
    "autotuning": ("DeepSpeed's autotuner", _enabled_off),
    "hybrid_engine": ("DeepSpeed's RLHF hybrid engine", _enabled_off),
    "quantize_training": ("quantization-aware training", _enabled_off),
    "nebula": ("Nebula checkpointing", _enabled_off),
    "sparse_gradients": ("sparse embedding gradients", _falsy),
    "communication_data_type": ("a separate communication dtype (zeropp communicates in the compute dtype)",
                                _falsy),
    "memory_breakdown": ("DeepSpeed's memory breakdown prints; see engine.model_state_bytes()", _falsy),
    "dump_state": ("DeepSpeed's state dump at start-up", _falsy),
}


@dataclass
class Translation:
    """The rewritten config and what happened to it."""

    raw: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # warnings: what was rewritten or dropped, and why
    errors: list[str] = field(default_factory=list)  # contradictions (a legacy key beside its new form)
    not_supported: list[str] = field(default_factory=list)  # DeepSpeed features switched on that zeropp lacks


def translate_legacy(raw: Mapping[str, Any]) -> Translation:
    """Rewrite ``raw`` (parsed JSON) as described in the module docstring; ``raw`` itself is not changed."""
    out = Translation({k: v for k, v in raw.items() if not (isinstance(k, str) and k.startswith("_"))})
    tree = out.raw
    for key, why in IGNORED_KEYS.items():
        if key in tree:
            del tree[key]
            out.notes.append(f"{key}: ignored: DeepSpeed does not read this key either ({why})")
    for key in [k for k in tree if isinstance(k, str) and "." in k]:
        # TRL's prepare_deepspeed writes "zero_optimization.reduce_bucket_size" & co. at the top level; DeepSpeed
        # reads sections, never such a key, so they change nothing there either
        del tree[key]
        out.notes.append(f"{key}: ignored: a dotted key at the top level; DeepSpeed does not read it either (the "
                         f"setting belongs in its section: {key.split('.')[0]}: {{{key.split('.', 1)[1]}: ...}})")
    for key, (what, is_off) in NOT_IMPLEMENTED_FEATURES.items():
        if key in tree:
            value = tree.pop(key)
            if not is_off(value):
                out.not_supported.append(f"{key}: not supported yet: {json_short(value)} ({what}); accepted: "
                                         "the section switched off or left out")
    if "bfloat16" in tree:
        if "bf16" in tree:
            out.errors.append("bfloat16: given beside bf16 (bfloat16 is DeepSpeed's older name); accepted: one")
        else:
            tree["bf16"] = tree.pop("bfloat16")
            out.notes.append("bfloat16: DeepSpeed's older name of bf16, read as bf16")
    zero = tree.get("zero_optimization")
    if isinstance(zero, bool):
        tree["zero_optimization"] = {"stage": 1 if zero else 0}
        if zero:
            tree["zero_optimization"]["allgather_bucket_size"] = tree.pop("allgather_size", 500_000_000)
        out.notes.append(f"zero_optimization: {str(zero).lower()} is DeepSpeed's deprecated form, read as "
                         f"{{\"stage\": {1 if zero else 0}}}")
    elif isinstance(zero, Mapping):
        zero = tree["zero_optimization"] = _field_names(_offload_flags(dict(zero), out), out)
        if "aio" in zero and "aio" not in tree:  # Hugging Face's docs print it here; DeepSpeed rejects it
            tree["aio"] = zero.pop("aio")
            out.notes.append("zero_optimization.aio: misplaced (DeepSpeed reads aio at the top level and "
                             "rejects it here), read as the top-level aio section")
    return out


_OFFLOAD_FLAGS = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))

# DeepSpeed's ZeRO config takes its stage-3 keys under two names, the field's and the "stage3_" one (its alias);
# zeropp's schema has the "stage3_" names.
_STAGE3_FIELDS = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                  "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                  "module_granularity_threshold")


def _field_names(zero: dict[str, Any], out: Translation) -> dict[str, Any]:
    """DeepSpeed's field names of the stage-3 keys, read as their "stage3_" names (both are DeepSpeed's)."""
    for name in _STAGE3_FIELDS:
        if name not in zero:
            continue
        if f"stage3_{name}" in zero:
            out.errors.append(f"zero_optimization.{name}: given beside zero_optimization.stage3_{name} (two names "
                              "of one DeepSpeed key); accepted: one of them")
            continue
        zero[f"stage3_{name}"] = zero.pop(name)
    return zero


def _offload_flags(zero: dict[str, Any], out: Translation) -> dict[str, Any]:
    """DeepSpeed's deprecated boolean offload flags as the offload sections they stand for."""
    for old, new in _OFFLOAD_FLAGS:
        if old not in zero:
            continue
        value = as_flag(zero.pop(old))
        if new in zero:
            out.errors.append(f"zero_optimization.{old}: given beside zero_optimization.{new} (its deprecated "
                              "form); accepted: one of them")
        elif value is True:
            zero[new] = {"device": "cpu"}
        elif value not in (False, None):
            out.errors.append(f"zero_optimization.{old}: expected true or false, got {json_short(value)}; "
                              "accepted: true or false")
            continue
        out.notes.append(f"zero_optimization.{old}: DeepSpeed's deprecated flag, read as zero_optimization.{new}"
                         + (" {\"device\": \"cpu\"}" if value is True else " left out"))
    if "cpu_offload_use_pin_memory" in zero:
        pin = as_flag(zero.pop("cpu_offload_use_pin_memory"))
        if pin not in (True, False, None):
            out.errors.append(f"zero_optimization.cpu_offload_use_pin_memory: expected true or false, got "
                              f"{json_short(pin)}; accepted: true or false")
            return zero
        for _, new in _OFFLOAD_FLAGS:
            section = zero.get(new)
            if isinstance(section, Mapping) and pin is True:
                zero[new] = {**section, "pin_memory": section.get("pin_memory", True)}
        out.notes.append("zero_optimization.cpu_offload_use_pin_memory: DeepSpeed's deprecated flag, read as "
                         "pin_memory of the offload sections")
    return zero


def json_short(value: Any) -> str:
    """``value`` as short JSON, for messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
