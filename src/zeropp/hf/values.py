"""What a ``transformers.TrainingArguments`` says about a zeropp config: the ``"auto"`` values and the keys the
Trainer owns.

:func:`auto_values` gives, by dotted JSON path, what Hugging Face's own DeepSpeed integration writes into
``"auto"`` keys (``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize`` in
``transformers/integrations/deepspeed.py``), in zeropp's :class:`~zeropp.config.auto.AutoValues`.

:func:`trainer_config` prepares a raw config for a Trainer run. The Trainer drives the loop, so the keys that
shape it — batch sizes, accumulation, clipping, precision — are the Trainer's: the config may leave them out,
write ``"auto"`` or repeat the same value. Any key Hugging Face checks (those above, the optimizer's lr, betas,
eps and weight decay, the scheduler's peak lr, length and warm-up) that contradicts the arguments is an error
naming both sides, as in Hugging Face's integration; every problem is listed at once.

Pure functions: no process group, no I/O.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from zeropp.config.loader import ConfigError, ZeroppConfig
from zeropp.config.auto import AUTO, AutoValues

_ABSENT = object()

# dotted path -> the TrainingArguments field(s) its value comes from (named in mismatch errors)
SOURCES: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "world_size x per_device_train_batch_size x gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1, adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "(none: 0)",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.total_num_steps": "max_steps (the run's optimizer steps)",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}
# Filled when "auto" but never checked (Hugging Face's fill_only): not a Trainer argument.
_FILL_ONLY = frozenset({"scheduler.params.warmup_min_lr"})
# The Trainer's loop depends on these: a config that leaves them out takes the Trainer's values.
TRAINER_OWNED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "gradient_clipping", "fp16.enabled", "bf16.enabled")


class TrainerConfigMismatch(ConfigError):
    """Config values that contradict the ``TrainingArguments`` (each line names both)."""

    what = "config values contradict the TrainingArguments (write \"auto\", or leave the key out)"


def hidden_size_of(model: Any) -> Optional[int]:
    """The model's hidden size as Hugging Face sizes "auto" buckets from it: ``config.hidden_size``, else the
    largest of ``config.hidden_sizes``, else the same two on ``config.text_config``; None without one."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        size = getattr(cfg, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
        sizes = getattr(cfg, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
    return None


def auto_values(args: Any, model: Any = None, num_training_steps: Optional[int] = None) -> AutoValues:
    """What Hugging Face's Trainer fills into ``"auto"`` config keys, from ``args`` (a
    ``transformers.TrainingArguments``), ``model`` (its ``config.hidden_size`` sizes the bucket keys) and the
    run's number of optimizer steps (the scheduler's length and warm-up; left out when None).

    Returns :class:`~zeropp.config.auto.AutoValues` whose ``given`` maps dotted JSON paths to values, for
    :func:`zeropp.config.load_config` (``load_config(raw, auto_values(args, model, steps))``).
    """
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    given: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": args.world_size * micro * gas,  # DeepSpeed's identity
        "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": args.learning_rate,
        "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
        "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
    }
    if num_training_steps is not None:
        given["scheduler.params.total_num_steps"] = num_training_steps
        # at least 1: DeepSpeed rejects a warm-up of 0 steps (Hugging Face clamps it the same way)
        given["scheduler.params.warmup_num_steps"] = max(1, args.get_warmup_steps(num_training_steps))
    return AutoValues(given=given, hidden_size=hidden_size_of(model))


def _get(tree: Mapping, path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _put(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _copy(raw: Mapping) -> dict:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def mismatch(path: str, ours: Any, theirs: Any) -> str:
    """One error line: the config's value and the TrainingArguments' value it contradicts."""
    return f"{path}: {ours!r} in the config, but TrainingArguments {SOURCES.get(path, path)} gives {theirs!r}"


def trainer_config(raw: Mapping[str, Any], values: AutoValues) -> dict:
    """A copy of ``raw`` with the Trainer-owned keys it leaves out filled from ``values`` (``"auto"`` keys stay
    for :func:`~zeropp.config.load_config` to resolve); raises :class:`TrainerConfigMismatch` listing every
    explicit value that contradicts ``values``."""
    tree = _copy(raw)
    problems = []
    for path, theirs in values.given.items():
        ours = _get(tree, path)
        if ours is _ABSENT:
            if path in TRAINER_OWNED and (not path.endswith(".enabled") or theirs):
                _put(tree, path, theirs)  # a precision section is only added to switch it on
        elif ours != AUTO and path not in _FILL_ONLY and not _same(ours, theirs):
            problems.append(mismatch(path, ours, theirs))
    if problems:
        raise TrainerConfigMismatch(problems)
    return tree


def check_trainer_owned(cfg: ZeroppConfig, values: AutoValues, world_size: int) -> None:
    """After parsing: the loop-shaping settings the engine will use equal the Trainer's (this also covers
    DeepSpeed's older spellings, e.g. a ``bfloat16`` section, which :func:`trainer_config` does not read)."""
    given = values.given
    plan = cfg.resolve_batch(world_size)
    used = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_per_rank,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "train_batch_size": plan.train_batch_size,
        "gradient_clipping": cfg.gradient_clipping,
        "fp16.enabled": cfg.fp16.enabled,
        "bf16.enabled": cfg.bf16.enabled,
    }
    problems = [mismatch(path, value, given[path]) for path, value in used.items()
                if path in given and not _same(value, given[path])]
    if problems:
        raise TrainerConfigMismatch(problems)
