"""DeepSpeed-style JSON config, read once at the edge into typed, frozen pydantic models.

    cfg = load_config("ds_config.json")      # or a dict
    plan = cfg.resolve_batch(world_size)     # BatchPlan(train_batch_size, micro_batch_per_rank, ...)

Key names are DeepSpeed's. Three kinds of key (see docs/config.md for each one):

* implemented: zeropp does what the key asks;
* accepted, tuning only: the key tunes something zeropp does differently (bucket sizes it rounds,
  `wall_clock_breakdown`...) or asks for what zeropp always does (`contiguous_gradients`, `reduce_scatter:
  true`); it loads and changes nothing;
* not supported yet: a value asking for behaviour zeropp lacks; `check_supported` raises
  `NotSupportedError` naming its JSON path. The rules live in one table, `NOT_SUPPORTED`, so a row can be
  deleted when its feature lands.

Anything else (an unknown key, a typo, a wrong type, a value out of range) raises one `ConfigError` that
lists every problem as `<dotted.json.path>: <what is wrong>; accepted: <what is accepted>`.
"""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from zeropp.config.auto import AutoValues, resolve_auto
from zeropp.config.legacy import json_short, translate_legacy
from zeropp.config.relaxed_json import RelaxedJSONError, loads_config
from zeropp.config.schema import (
    DSBool,
    DSSteps,
    DataTypesConfig,
    UNBUILT_OPTIMIZERS,
    OPTIMIZER_TYPES,
    STATUS_IMPLEMENTED,
    STATUS_PARTIAL,
    STATUS_TUNING,
    UNION_TAGS,
    AdamOptimizerConfig,
    ActivationCheckpointingConfig,
    CheckpointConfig,
    AdamParams,
    AioConfig,
    AnyOptimizerConfig,
    Bf16Config,
    CompileConfig,
    DSInt,
    F,
    Fp16Config,
    Number,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    OtherOptimizerConfig,
    Section,
    SGDOptimizerConfig,
    SGDParams,
    TensorParallelConfig,
    TopologyConfig,
    ZeroConfig,
    deepcompile_keys,
    problem,
)
from zeropp.config.scheduler import (
    SCHEDULER_TAGS,
    SCHEDULER_TYPES,
    AnySchedulerConfig,
    LRRangeTestConfig,
    LRRangeTestParams,
    OneCycleConfig,
    OneCycleParams,
    OtherSchedulerConfig,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupCosineLRParams,
    WarmupDecayLRConfig,
    WarmupDecayLRParams,
    WarmupLRConfig,
    WarmupLRParams,
)

__all__ = [
    "ConfigError", "ConfigWarning", "NotSupportedError", "load_config", "check_supported", "NOT_SUPPORTED", "Unsupported",
    "ZeroppConfig", "BatchPlan", "ZeroConfig", "Bf16Config", "Fp16Config", "TopologyConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "AdamOptimizerConfig",
    "SGDOptimizerConfig", "OtherOptimizerConfig", "AdamParams", "SGDParams", "SchedulerConfig",
    "WarmupLRConfig", "WarmupDecayLRConfig", "WarmupCosineLRConfig", "OtherSchedulerConfig",
    "WarmupLRParams", "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleConfig", "OneCycleParams",
    "LRRangeTestConfig", "LRRangeTestParams", "OPTIMIZER_TYPES", "SCHEDULER_TYPES",
]


# ------------------------------------------------------------------------------------------------- errors
class ConfigError(ValueError):
    """An invalid config. `problems` holds one line per problem, each starting with its JSON path."""

    what = "problems in the config"

    def __init__(self, problems: str | list[str], source: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"config file {self.source!r}: " if self.source else ""
        if len(self.problems) == 1:
            return where + self.problems[0]
        head = f"{where}{len(self.problems)} {self.what}:"
        return "\n  - ".join([head, *self.problems])


class NotSupportedError(ConfigError):
    """A valid DeepSpeed setting that asks for behaviour zeropp does not have yet."""

    what = "settings in the config are not supported yet"


class ConfigWarning(UserWarning):
    """A config key read in another form than written (DeepSpeed's deprecated spellings) or set aside
    because DeepSpeed does not read it either (see `zeropp.config.legacy`)."""


# ------------------------------------------------------------------------------------------------- schema
class BatchPlan(NamedTuple):
    """Resolved batch sizes: train_batch_size = micro_batch_per_rank * gradient_accumulation_steps * world."""

    train_batch_size: int
    micro_batch_per_rank: int
    gradient_accumulation_steps: int


class ZeroppConfig(Section):
    """The whole config file: DeepSpeed's top-level keys plus zeropp's `topology` extension."""

    train_batch_size: DSInt | None = F(None, ge=1, doc="Global batch per optimizer step (all ranks, all "
                                       "accumulation steps).")
    train_micro_batch_size_per_gpu: DSInt | None = F(None, ge=1, doc="Batch per rank per forward/backward.")
    gradient_accumulation_steps: DSInt | None = F(None, ge=1, doc="Micro-batches accumulated per step.")
    optimizer: AnyOptimizerConfig | None = F(None, doc="Optimizer; null = AdamW(lr=1e-3) (see zeropp.optim).")
    scheduler: AnySchedulerConfig | None = F(None, doc="Learning-rate schedule; null = constant lr.")
    bf16: Bf16Config = F(default_factory=Bf16Config, doc="bfloat16 mixed precision.")
    fp16: Fp16Config = F(default_factory=Fp16Config, doc="float16 mixed precision (not supported yet).",
                         status=STATUS_PARTIAL)
    zero_optimization: ZeroConfig = F(default_factory=ZeroConfig, doc="ZeRO stage and ZeRO++ switches.")
    topology: TopologyConfig = F(default_factory=TopologyConfig, doc="zeropp extension: node layout.")
    gradient_clipping: Number = F(0.0, ge=0, doc="Clip the global gradient norm to this; 0 = off.")
    steps_per_print: DSSteps = F(10, ge=1, doc="With `wall_clock_breakdown`, print the time report every this "
                                 "many optimizer steps (`inf`, as accelerate writes it: never).",
                                 status=STATUS_IMPLEMENTED)
    wall_clock_breakdown: DSBool = F(False, doc="Print `engine.time_report()` (where each step's time went) on "
                                   "rank 0 every `steps_per_print` steps.", status=STATUS_IMPLEMENTED)
    prescale_gradients: DSBool = F(False, doc="Divide gradients by the world size before the reduction instead of "
                                 "after it (the same mean, rounded differently in 16 bits).")
    gradient_predivide_factor: Number = F(1.0, gt=0, doc="Divide gradients by this before the reduction and by "
                                          "world / this after it (for gradient_allreduce_op \"mean\").")
    gradient_allreduce_op: Literal["mean", "sum"] = F("mean", doc="What the ranks' gradients become: their mean "
                                                      "(DeepSpeed's default) or their sum; any case (\"SUM\"), as "
                                                      "DeepSpeed reads it.")
    zero_allow_untested_optimizer: DSBool = F(False, doc="DeepSpeed's guard for client optimizers.",
                                            status=STATUS_TUNING)
    comm_timeout_s: Number = F(300.0, gt=0, doc="zeropp extension: seconds any collective may wait for the "
                               "other ranks before it fails with PeerLostError (a killed or lost rank never hangs "
                               "the rest).")
    broadcast_rank0_weights: DSBool = F(True, doc="zeropp extension: at initialize every rank takes rank 0's "
                                      "weights and buffers, unit by unit, as DeepSpeed broadcasts the model "
                                      "(weights loaded on rank 0 only train as they should). false: each rank keeps "
                                      "its own values, for models built identically; ranks that disagree then get "
                                      "a RankDisagreementWarning naming a unit.")
    zero_force_ds_cpu_optimizer: DSBool = F(True, doc="DeepSpeed's guard that offload runs its own CPU Adam; "
                                          "zeropp runs Adam/AdamW sections as its CpuAdam under offload and a "
                                          "client optimizer as given.", status=STATUS_TUNING)
    activation_checkpointing: ActivationCheckpointingConfig = F(
        default_factory=ActivationCheckpointingConfig, doc="Settings of DeepSpeed's checkpointing API.")
    checkpoint: CheckpointConfig = F(default_factory=CheckpointConfig, doc="DeepSpeed's checkpoint settings: tag "
                                     "validation, universal and node-local loading, the writer.",
                                     status=STATUS_PARTIAL)
    aio: AioConfig = F(default_factory=AioConfig, doc="DeepSpeed's libaio settings for NVMe offload.",
                       status=STATUS_TUNING)
    tensor_parallel: TensorParallelConfig = F(default_factory=TensorParallelConfig, doc="DeepSpeed's "
                                              "automatic tensor parallelism (off only).", status=STATUS_PARTIAL)
    data_types: DataTypesConfig = F(default_factory=DataTypesConfig, doc="The gradient accumulation dtype "
                                    "(the training dtype only).", status=STATUS_PARTIAL)
    compile: CompileConfig = F(default_factory=CompileConfig, doc="torch.compile at initialize (engine.compile); "
                               "DeepCompile is not supported yet.", status=STATUS_PARTIAL)

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _op_in_any_case(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v  # DeepSpeed lower-cases it

    @model_validator(mode="after")
    def _one_precision(self) -> ZeroppConfig:
        if self.bf16.enabled and self.fp16.enabled:
            raise problem("bf16.enabled and fp16.enabled are both true", "at most one of them true",
                          path="fp16.enabled")
        return self

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a top-level key as DeepSpeed's engine keeps its config (a dict: sections as dicts), for
        integrations that read ``engine.config.get("zero_optimization", {}).get("stage")``."""
        if key not in type(self).model_fields:
            return default
        value = getattr(self, key)
        return value.model_dump() if isinstance(value, BaseModel) else value

    def resolve_batch(self, world_size: int) -> BatchPlan:
        """Derive the three batch sizes for `world_size` ranks, as DeepSpeed does.

        Any two of train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps give
        the third; one alone is completed with gradient_accumulation_steps = 1; gradient_accumulation_steps
        alone, or none at all, is an error; so is a set that does not satisfy train = micro * gas * world.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        train, micro, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps)
        if train is None and micro is None:
            raise ConfigError("train_batch_size, train_micro_batch_size_per_gpu: neither is set; "
                              "accepted: train_batch_size and/or train_micro_batch_size_per_gpu "
                              "(gradient_accumulation_steps alone cannot size a batch)")
        if train is None:
            gas = gas or 1
            train = micro * gas * world_size
        elif micro is None:
            gas = gas or 1
            micro = train // (gas * world_size)
        elif gas is None:
            gas = train // (micro * world_size)
        if micro < 1 or gas < 1 or train != micro * gas * world_size:
            raise ConfigError(self._batch_mismatch(world_size))
        return BatchPlan(train, micro, gas)

    def _batch_mismatch(self, world_size: int) -> str:
        """The error line for batch sizes that do not fit `world_size`."""
        given = ", ".join(f"{k}={_json(getattr(self, k))}" for k in _BATCH_KEYS)
        return (f"{', '.join(_BATCH_KEYS)}: inconsistent for world size {world_size} ({given}); accepted: "
                f"train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                f"world size, with every value a positive integer")


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


# ---------------------------------------------------------------------------------- not-supported table
_ABSENT = object()


@dataclass(frozen=True)
class Unsupported:
    """One "not supported yet" rule: the value at `path` is rejected when `rejects(value)` is true."""

    path: str
    rejects: Callable[[Any], bool]
    why: str

    def check(self, cfg: ZeroppConfig) -> str | None:
        """The error line when `cfg` hits this rule, else None."""
        value = _lookup(cfg, self.path)
        if value is _ABSENT or not self.rejects(value):
            return None
        return f"{self.path}: not supported yet: {_json(value)} ({self.why})"


# Delete a row when its feature lands (and update docs/config.md). A row's path is dotted JSON.
NOT_SUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("fp16.fp16_master_weights_and_grads", lambda v: v is True,
                "fp16 master weights (zeropp keeps fp32 masters); accepted: false"),
    Unsupported("optimizer.type", lambda v: v in UNBUILT_OPTIMIZERS,
                f"DeepSpeed-only optimizer; accepted: {', '.join(OPTIMIZER_TYPES)}"),
    Unsupported("tensor_parallel.autotp_size", lambda v: v > 1,
                "tensor parallelism; zeropp partitions over data-parallel ranks only; accepted: 0 or 1"),
    Unsupported("zero_optimization.mics_shard_size", lambda v: v > 0,
                "MiCS sub-group sharding; accepted: -1"),
    Unsupported("aio.use_gds", lambda v: v is True, "GPUDirect Storage; accepted: false"),
    Unsupported("checkpoint.use_node_local_storage", lambda v: v is True,
                "checkpoints on storage each node sees alone; rank 0 publishes one manifest over every rank's "
                "shard; accepted: false"),
    Unsupported("checkpoint.parallel_write.pipeline_stage", lambda v: v is True,
                "pipeline parallelism; zeropp partitions over data-parallel ranks only; accepted: false"),
    Unsupported("checkpoint.writer.type", lambda v: v == "MOCK",
                "a writer that writes nothing; accepted: \"PYTHON\" or \"FAST\" (zeropp writes its own files)"),
    *(Unsupported(f"compile.{key}", lambda v, d=default: v != d,
                  f"DeepCompile, DeepSpeed's ZeRO as compiler passes; torch.compile works without it "
                  f"(compile.enabled, engine.compile); accepted: {json_short(default)}")
      for key, default in deepcompile_keys().items()),
)


def _lookup(cfg: BaseModel, path: str) -> Any:
    """The value at dotted `path` in `cfg`, or `_ABSENT` when a section on the way is null or lacks it."""
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part, _ABSENT) if value is not None else _ABSENT
        if value is _ABSENT:
            return _ABSENT
    return value


ZEROPP_KEYS = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients",
               "zero_quantized_nontrainable_weights")


def _zeropp_below_stage3(cfg: ZeroppConfig) -> list[str]:
    """ZeRO++ techniques act on stage 3's gathers and reductions; below stage 3 they would do nothing."""
    zero = cfg.zero_optimization
    if zero.stage == 3:
        return []
    on = [k for k in ZEROPP_KEYS
          if (getattr(zero, k) > 1 if k == "zero_hpz_partition_size" else getattr(zero, k) is True)]
    return [f"zero_optimization.{k}: needs zero_optimization.stage 3 (got stage {zero.stage}); "
            f"accepted below stage 3: false (1 for zero_hpz_partition_size)" for k in on]


def _reduction_conflicts(cfg: ZeroppConfig) -> list[str]:
    """qgZ is a quantized reduce-scatter: it cannot average by all-reduce."""
    zero = cfg.zero_optimization
    if not zero.reduce_scatter and zero.zero_quantized_gradients:
        return ["zero_optimization.reduce_scatter: false cannot go with zero_quantized_gradients: true (qgZ is a "
                "quantized reduce-scatter); accepted: true, or zero_quantized_gradients false"]
    return []


def _data_type_conflicts(cfg: ZeroppConfig) -> list[str]:
    """Gradients accumulate in the training dtype; a config asking for another one is refused, not ignored."""
    want = cfg.data_types.grad_accum_dtype
    have = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    if want is None or want == have:
        return []
    return [f"data_types.grad_accum_dtype: not supported yet: {want!r} (zeropp accumulates gradients in the "
            f"training dtype, here {have}); accepted: null or {have!r}"]


def _offload_conflicts(cfg: ZeroppConfig) -> list[str]:
    """Offload settings that cannot work together (each line names the key to change)."""
    zero = cfg.zero_optimization
    opt, par = zero.offload_optimizer, zero.offload_param
    out = []
    for key, section in (("offload_optimizer", opt), ("offload_param", par)):
        if section is not None and section.device == "nvme" and not section.nvme_path:
            out.append(f"zero_optimization.{key}.nvme_path: required when device is \"nvme\"")
    if par is not None and par.device != "none":
        if zero.stage != 3:
            out.append(f"zero_optimization.offload_param.device: needs zero_optimization.stage 3 (got stage "
                       f"{zero.stage}); accepted below stage 3: \"none\"")
        if zero.zero_hpz_partition_size > 1:
            out.append("zero_optimization.zero_hpz_partition_size: not supported with offload_param (the "
                       "secondary copy would stay in memory); accepted: 1")
        if zero.zero_quantized_nontrainable_weights:
            out.append("zero_optimization.zero_quantized_nontrainable_weights: not supported with offload_param "
                       "(the frozen int8 shards stay on the compute device); accepted: false")
        if par.device == "nvme" and par.buffer_count < 2:
            out.append(f"zero_optimization.offload_param.buffer_count: at least 2 with device \"nvme\" (the "
                       f"shard being gathered and the next one); got {par.buffer_count}")
    if zero.zero_quantized_nontrainable_weights and opt is not None and opt.device == "nvme":
        out.append("zero_optimization.zero_quantized_nontrainable_weights: not supported with offload_optimizer "
                   "device \"nvme\" (frozen int8 rows have no optimizer record to swap); accepted: false")
    par_nvme = par is not None and par.device == "nvme"
    if opt is not None and opt.delayed_update and par_nvme:
        out.append("zero_optimization.offload_optimizer.delayed_update: not supported with offload_param "
                   "device \"nvme\"; accepted: false")
    if opt is not None and opt.device == "nvme":
        if zero.stage == 0:
            out.append("zero_optimization.offload_optimizer.device: \"nvme\" needs zero_optimization.stage "
                       "1, 2 or 3 (got stage 0)")
        if opt.delayed_update:
            out.append("zero_optimization.offload_optimizer.delayed_update: not supported with device "
                       "\"nvme\"; accepted: false")
    return out


def _adam_conflicts(cfg: ZeroppConfig) -> list[str]:
    """Adam settings that cannot work together (UncorrectedAdam and CpuAdam have no amsgrad or maximize)."""
    opt = cfg.optimizer
    if not isinstance(opt, AdamOptimizerConfig):
        return []
    offload = cfg.zero_optimization.offload_optimizer
    offloaded = offload is not None and offload.device != "none"
    out = []
    for key in ("amsgrad", "maximize"):
        if getattr(opt.params, key) and (not opt.params.bias_correction or offloaded):
            why = "bias_correction false" if not opt.params.bias_correction else "offload_optimizer"
            out.append(f"optimizer.params.{key}: not supported yet with {why}; accepted: false")
    return out


def check_supported(cfg: ZeroppConfig, source: str | None = None, more: Iterable[str] = ()) -> None:
    """Raise one `NotSupportedError` listing every `NOT_SUPPORTED` rule that `cfg` hits (and `more`: the
    DeepSpeed features switched on that `translate_legacy` set aside)."""
    hits = list(more) + [line for rule in NOT_SUPPORTED if (line := rule.check(cfg)) is not None]
    hits += _zeropp_below_stage3(cfg) + _offload_conflicts(cfg) + _adam_conflicts(cfg) + _reduction_conflicts(cfg)
    hits += _data_type_conflicts(cfg)
    if hits:
        raise NotSupportedError(hits, source)


# ------------------------------------------------------------------------------------------------ loading
def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | ZeroppConfig,
                auto: AutoValues | None = None) -> ZeroppConfig:
    """Read a config from a JSON file path, a dict, or an existing `ZeroppConfig`, and check support.

    DeepSpeed's deprecated spellings are read as DeepSpeed reads them, with a `ConfigWarning` (see
    `zeropp.config.legacy`); `"auto"` values (Hugging Face's) are resolved from `auto` (`zeropp.config.auto`).
    Raises `ConfigError` (missing file, invalid JSON with its line, unknown keys, wrong types, an `"auto"`
    nothing resolves...) or `NotSupportedError` (valid DeepSpeed settings zeropp does not implement yet).
    """
    if isinstance(source, ZeroppConfig):
        check_supported(source)
        return source
    if not isinstance(source, (Mapping, str, os.PathLike)):
        raise ConfigError(f"<config>: got a {type(source).__name__}; accepted: a JSON file path, a dict "
                          "or a ZeroppConfig")
    origin = None if isinstance(source, Mapping) else os.fspath(source)
    raw: Any = source if origin is None else read_json(origin)
    if not isinstance(raw, Mapping):
        return parse_config(raw, origin)  # raises: the top level is not an object
    legacy = translate_legacy(raw)
    resolved, unresolved = resolve_auto(legacy.raw, auto)
    if legacy.errors or unresolved:
        raise ConfigError(legacy.errors + unresolved, origin)
    for note in legacy.notes:
        warnings.warn(f"{'config file ' + repr(origin) if origin else 'config'}: {note}", ConfigWarning,
                      stacklevel=2)
    cfg = parse_config(resolved, origin)
    check_supported(cfg, origin, legacy.not_supported)
    return cfg


def read_json(path: str) -> Any:
    """Parse the JSON file at `path`; every failure is a `ConfigError` naming the file.

    A file that is not strict JSON is read as DeepSpeed reads config files, with ``hjson`` when it is installed,
    else as JSON with comments, unquoted keys and trailing commas (`zeropp.config.relaxed_json`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", path) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the file: {err}", path) from None
    try:
        try:
            return json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError:
            return loads_config(text, _no_duplicate_keys)  # Hjson, or relaxed JSON: DeepSpeed reads them
    except RelaxedJSONError as err:
        raise ConfigError(f"invalid JSON at line {err.line}, column {err.column}: {err.message}", path) from None
    except _DuplicateKey as err:
        raise ConfigError(f"duplicate key {err.args[0]!r} in one JSON object (DeepSpeed rejects it too)",
                          path) from None


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key given twice is a mistake, not "last one wins"."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_config(raw: Any, source: str | None = None) -> ZeroppConfig:
    """Validate `raw` (parsed JSON) into a `ZeroppConfig` without the support check.

    Every pydantic error becomes one line of a single `ConfigError`.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"<config>: the top level is a {type(raw).__name__}; accepted: a JSON object",
                          source)
    try:
        return ZeroppConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError([describe_error(e) for e in err.errors()], source) from None


# -------------------------------------------------------------------------------------- error rendering
def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and part.startswith("<")


def _dotted(loc: tuple[Any, ...] | list[Any]) -> str:
    """JSON path of a pydantic location: union tags dropped, list indices as [i]."""
    out = ""
    for part in loc:
        if _is_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<config>"


def _walk(loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model that owns the last key of `loc`, and that key's field (None when unknown)."""
    model: type[BaseModel] | None = ZeroppConfig
    owner, field = None, None
    for part in loc:
        if _is_tag(part):
            model = UNION_TAGS.get(part) or SCHEDULER_TAGS.get(part)
            continue
        if model is None or not isinstance(part, str):
            return None, None
        owner, field = model, model.model_fields.get(part)
        model = _section_in(field.annotation) if field is not None else None
    return owner, field


def _section_in(annotation: Any) -> type[BaseModel] | None:
    """The single model class inside `annotation` (X, X | None); None for a union of several or none."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is typing.Annotated:
        return _section_in(typing.get_args(annotation)[0])
    found = [m for a in typing.get_args(annotation) if (m := _section_in(a)) is not None]
    return found[0] if len(found) == 1 else None


def _expected(field: FieldInfo | None) -> str:
    """What a field accepts, in JSON words."""
    return _type_words(field.annotation) if field is not None else "see docs/config.md"


def _type_words(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_words(args[0])
    if origin is typing.Literal:
        return " or ".join(_json(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args)
    if origin is tuple:  # tuple[float, ...]: a list of any length (a scheduler's per-group values)
        return "a list of numbers" if args[-1] is Ellipsis else f"a list of {len(args)} numbers"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             type(None): "null", dict: "an object"}
    if annotation in words or origin in words:
        return words.get(annotation) or words[origin]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "an object"
    return "see docs/config.md"


_json = json_short  # a short JSON rendering of a value, for messages


_UNKNOWN_KEY_HINTS = {
    "max_grad_norm": "not an optimizer parameter; use the top-level 'gradient_clipping' (as DeepSpeed says)",
}


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """The message for an unknown key: a hint or the closest accepted key, then all accepted keys."""
    owner, _ = _walk(loc)
    key = str(loc[-1]) if loc else ""
    keys = list(owner.model_fields) if owner is not None else []
    what = "unknown key"
    if key in _UNKNOWN_KEY_HINTS:
        what += "; " + _UNKNOWN_KEY_HINTS[key]
    elif match := _closest(key, keys):
        what += f"; did you mean {match!r}?"
    return f"{what}; accepted keys: {', '.join(keys) or 'none'}"


def _closest(key: str, keys: list[str]) -> str | None:
    """The accepted key that `key` most likely misspells (case-insensitive exact match first)."""
    for k in keys:
        if k.lower() == key.lower():
            return k
    found = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return found[0] if found else None


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


def describe_error(err: ErrorDetails) -> str:
    """One `<path>: <what is wrong>; accepted: <what is accepted>` line for one pydantic error."""
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    path = _dotted(loc + ((ctx["path"],) if "path" in ctx else ()))
    _, field = _walk(loc)
    got = _json(err.get("input"))
    if kind == "zeropp":
        return f"{path}: {ctx['problem']}; accepted: {ctx['accepted']}"
    if kind == "extra_forbidden":
        return f"{path}: {_unknown_key(loc)}"
    if kind == "missing":
        return f"{path}: required key is missing; accepted: {_expected(field)}"
    if kind in _BOUNDS:
        name, sign = _BOUNDS[kind]
        kind_words = _expected(field).replace(" or null", "")
        return f"{path}: got {got}; accepted: {kind_words} {sign} {ctx.get(name)}"
    if kind == "literal_error":
        return f"{path}: got {got}; accepted: {ctx.get('expected', _expected(field))}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: expected an object, got {got}; accepted: a JSON object {{...}}"
    if kind == "bool_type":
        return f"{path}: expected true or false, got {got}; accepted: true or false"
    return f"{path}: {err['msg'].lower()}, got {got}; accepted: {_expected(field)}"
