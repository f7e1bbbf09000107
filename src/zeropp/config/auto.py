"""``"auto"`` values, as Hugging Face's DeepSpeed integration writes them, resolved before validation.

Hugging Face's configs say ``"auto"`` where the Trainer fills a value in from its ``TrainingArguments``
(learning rate, batch sizes, precision, warm-up) or from the model (bucket sizes from ``hidden_size``).
DeepSpeed alone rejects them; zeropp resolves each one from what is known, and names every one it cannot:

* values given by the caller (the Trainer integration passes what the Trainer would: ``AutoValues.given``);
* batch sizes: an ``"auto"`` batch key is derived from the others (``train = micro x accumulation x world``),
  as DeepSpeed derives a missing one;
* sections zeropp will not use: the optimizer (scheduler) section when ``initialize`` was given an optimizer
  (scheduler) object;
* model-sized tuning keys (``reduce_bucket_size = hidden^2``, ``stage3_prefetch_bucket_size = 0.9 hidden^2``,
  ``stage3_param_persistence_threshold = 10 hidden``: the Trainer's formulas), from the model's
  ``config.hidden_size``; without one, the tuning-only keys take zeropp's default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

AUTO = "auto"

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_FROM_HIDDEN = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}
# keys that only tune what zeropp does differently: "auto" means "your default" (see docs/config.md)
_TUNING = ("zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
           "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
           "zero_optimization.allgather_bucket_size", "zero_optimization.sub_group_size", "steps_per_print",
           "wall_clock_breakdown",
           # accelerate fills it from its plugin (default false); save_16bit_model gathers whatever it says
           "zero_optimization.stage3_gather_16bit_weights_on_model_save")


@dataclass(frozen=True)
class AutoValues:
    """What is known to resolve ``"auto"`` with: explicit values by dotted path, the model's hidden size, and
    whether ``initialize`` was handed its own optimizer or scheduler (their sections are then unused)."""

    given: Mapping[str, Any] = field(default_factory=dict)
    hidden_size: Optional[int] = None
    client_optimizer: bool = False
    client_scheduler: bool = False


def auto_paths(raw: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``raw``."""
    if not isinstance(raw, Mapping):
        return []
    out = []
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value == AUTO:
            out.append(path)
        elif isinstance(value, Mapping):
            out += auto_paths(value, path + ".")
    return out


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree[part]
    tree[leaf] = value


def _drop(tree: dict, path: str) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree[part]
    del tree[leaf]


def _copy(raw: Mapping) -> dict:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def resolve_auto(raw: Mapping[str, Any], known: Optional[AutoValues] = None) -> tuple[dict, list[str]]:
    """A copy of ``raw`` with every resolvable ``"auto"`` replaced (or removed, where the key's absence
    means the derived value), and the list of problems (one per path nothing here can resolve)."""
    known = known or AutoValues()
    tree = _copy(raw)
    if known.client_optimizer and isinstance(tree.get("optimizer"), Mapping) and auto_paths(tree["optimizer"]):
        del tree["optimizer"]  # initialize's optimizer object replaces the section
    if known.client_scheduler and isinstance(tree.get("scheduler"), Mapping) and auto_paths(tree["scheduler"]):
        del tree["scheduler"]
    problems = []
    for path in auto_paths(tree):
        if path in known.given:
            _set(tree, path, known.given[path])
        elif path in _BATCH:
            _drop(tree, path)  # derived from the other batch keys (resolve_batch names it if it cannot be)
        elif path in _FROM_HIDDEN and known.hidden_size:
            _set(tree, path, _FROM_HIDDEN[path](int(known.hidden_size)))
        elif path in _TUNING:
            _drop(tree, path)
        else:
            problems.append(f"{path}: \"auto\" is filled in by Hugging Face's Trainer from its "
                            "TrainingArguments, and nothing given here resolves it; accepted: a value")
    return tree, problems
