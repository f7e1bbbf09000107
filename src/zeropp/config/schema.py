"""Pydantic models for the sections of a DeepSpeed-style config (the schema only).

`zeropp.config` holds the top-level `ZeroppConfig`, error reporting, the "not supported yet" table and
`load_config`; this module holds the section models it is built from. Key names are DeepSpeed's.

Validation is strict on purpose: a bool must be a JSON `true`/`false` (or `1`/`0`, which DeepSpeed's configs
write and whose meaning is plain), a string is never coerced to a
number, and an integer field takes an int or an integral float (`5e8`, `5.0e8`, as DeepSpeed does) but
rejects `1.5`. Errors raised here are pydantic errors; `zeropp.config` turns all of them into one
`ConfigError` that names each JSON path.

Every field carries `json_schema_extra={"status": ...}`, one of the `STATUS_*` strings below, so the docs
(docs/config.md) and a unit test can check that each accepted key is documented with its status.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, PydanticUndefined

STATUS_IMPLEMENTED = "implemented"
STATUS_TUNING = "accepted, tuning only"
STATUS_PARTIAL = "implemented; some values not supported yet"
STATUS_INERT = "accepted, no effect yet"
"""For keys of a feature that is not supported yet (fp16, offload): they load and change nothing."""
STATUS_NOT_YET = "not supported yet"


def problem(message: str, accepted: str, path: str | None = None) -> PydanticCustomError:
    """A validation error that `zeropp.config` renders as `<path>: <message>; accepted: <accepted>`.

    `path` (dotted, relative to where the error is raised) names a sub-key for model-level checks.
    """
    ctx: dict[str, str] = {"problem": message, "accepted": accepted}
    if path is not None:
        ctx["path"] = path
    return PydanticCustomError("zeropp", "{problem}; accepted: {accepted}", ctx)


def _show(value: Any) -> str:
    """`value` as it would look in JSON (for error messages)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def _integral(value: Any) -> int:
    """Accept an int or an integral float (`5e8`); reject bools, strings and `1.5`."""
    accepted = "an integer (numbers written like 5e8 are allowed)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise problem(f"expected an integer, got {_show(value)}", accepted)
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise problem(f"expected an integer, got {value!r} (not a whole number)", accepted)
        return int(value)
    return value


def _number(value: Any) -> float:
    """Accept an int or a finite float; reject bools and strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise problem(f"expected a number, got {_show(value)}", "a number")
    if not math.isfinite(value):
        raise problem(f"expected a finite number, got {value!r}", "a finite number")
    return float(value)


def _pair(value: Any) -> Any:
    """JSON has no tuples: read a 2-element list as a pair."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise problem(f"expected a list of 2 numbers, got {_show(value)}",
                      "a list of 2 numbers, e.g. [0.9, 0.999]")
    return tuple(value)


def as_flag(value: Any) -> Any:
    """`1` and `0` as `true` and `false`; anything else (a string, `2`, `1.0`) is left to strict validation."""
    return bool(value) if type(value) is int and value in (0, 1) else value


DSBool = Annotated[bool, BeforeValidator(as_flag)]
"""A bool that may be written `1`/`0`, as DeepSpeed's configs do (`"true"` and `2` stay errors)."""
DSInt = Annotated[int, BeforeValidator(_integral)]
"""An integer that may be written `5e8` (an integral float), as in DeepSpeed's configs."""
NEVER = 2**63 - 1
"""A step interval that never comes round."""


def _interval(value: Any) -> int:
    """A number of steps; positive infinity (accelerate writes ``steps_per_print: inf``) is :data:`NEVER`."""
    if isinstance(value, float) and value == math.inf:
        return NEVER
    return _integral(value)


DSSteps = Annotated[int, BeforeValidator(_interval)]
"""A step interval: an integer as :data:`DSInt`, or ``inf`` for never."""
Number = Annotated[float, BeforeValidator(_number)]
"""A finite number (int or float); never a string or bool."""


def F(default: Any = PydanticUndefined, *, doc: str, status: str = STATUS_IMPLEMENTED, **kw: Any) -> Any:
    """A documented field: `doc` becomes the description, `status` says how zeropp treats the key."""
    return Field(default, description=doc, json_schema_extra={"status": status}, **kw)


class Section(BaseModel):
    """Base of every config section: strict types, unknown keys rejected, values frozen."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------- precision
_BF16_NO_SCALING = ("fp16's loss-scaling key, found in bf16 sections of public configs: bf16 has fp32's "
                    "range and needs no loss scaling, and DeepSpeed does not read it under bf16 either.")


class Bf16Config(Section):
    """`bf16`: bfloat16 mixed precision (16-bit compute and communication, fp32 master weights)."""

    enabled: DSBool = F(False, doc="Train with bf16 weights/activations and fp32 master weights.")
    immediate_grad_update: DSBool = F(False, doc="DeepSpeed's bf16 optimizer: add each gradient into its fp32 "
                                    "accumulator as it is produced; zeropp reduces gradients into fp32 shards as "
                                    "buckets fill in every case.", status=STATUS_TUNING)
    loss_scale: Number = F(0.0, ge=0, doc=_BF16_NO_SCALING, status=STATUS_TUNING)
    initial_scale_power: DSInt = F(16, ge=0, doc=_BF16_NO_SCALING, status=STATUS_TUNING)
    loss_scale_window: DSInt = F(1000, ge=1, doc=_BF16_NO_SCALING, status=STATUS_TUNING)
    hysteresis: DSInt = F(2, ge=1, doc=_BF16_NO_SCALING, status=STATUS_TUNING)
    consecutive_hysteresis: DSBool = F(False, doc=_BF16_NO_SCALING, status=STATUS_TUNING)
    min_loss_scale: Number = F(1.0, gt=0, doc=_BF16_NO_SCALING, status=STATUS_TUNING)


class Fp16Config(Section):
    """`fp16`: float16 mixed precision with loss scaling (DeepSpeed's keys and semantics)."""

    enabled: DSBool = F(False, doc="Train in fp16: fp16 weights, activations and communication, fp32 masters, "
                      "loss scaling.")
    auto_cast: DSBool = F(False, doc="Cast floating-point inputs to fp16. The DeepSpeed alias's engine casts them "
                        "only when this is true, as DeepSpeed does; zeropp's own engine always casts them to the "
                        "compute dtype.", status=STATUS_IMPLEMENTED)
    loss_scale: Number = F(0.0, ge=0, doc="Static loss scale; 0 means dynamic.")
    initial_scale_power: DSInt = F(16, ge=0, doc="The dynamic scale starts at 2**this.")
    loss_scale_window: DSInt = F(1000, ge=1, doc="Steps without overflow before the scale doubles.")
    hysteresis: DSInt = F(2, ge=1, doc="Overflows absorbed before the scale is halved.")
    consecutive_hysteresis: DSBool = F(False, doc="Refill hysteresis on every good step; zeropp refills it when "
                                     "the scale doubles.", status=STATUS_TUNING)
    min_loss_scale: Number = F(1.0, gt=0, doc="Lower bound of the dynamic loss scale.")
    fp16_master_weights_and_grads: DSBool = F(False, doc="Keep master weights in fp16; `true` is not supported "
                                            "yet (zeropp keeps fp32 masters).", status=STATUS_PARTIAL)


# ------------------------------------------------------------------------------------------------ offload
OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: ZeRO-Offload (optimizer on the host), its delayed update, and
    ZeRO-Infinity's optimizer state on NVMe."""

    device: OffloadDevice = F("none", doc="Where fp32 masters, optimizer state and the step live: \"cpu\" "
                              "runs Adam/AdamW as zeropp's CpuAdam on host-resident masters (on this CPU build "
                              "host and device are the same memory); \"nvme\" also keeps masters, gradient "
                              "rows and optimizer state in a per-rank file under `nvme_path`, in memory only "
                              "while their unit is stepped (stages 1-3).")
    nvme_path: str | None = F(None, doc="Directory for the per-rank offload file (required with device "
                              "\"nvme\"; created if missing; space reserved at start-up).")
    pin_memory: DSBool = F(False, doc="On CUDA: page-locked host rows and copy buffers, so gradient downloads "
                         "and 16-bit uploads run asynchronously beside compute. No effect for a model on the "
                         "CPU.")
    buffer_count: DSInt = F(4, ge=1, doc="With device \"nvme\": how many units' optimizer records (master, "
                            "gradient row, Adam moments) may be in memory at once; 2 or more lets the next "
                            "unit's record be read while one is stepped.")
    pipeline_read: DSBool = F(False, doc="Overlap NVMe reads with compute (inert: reads are always "
                            "prefetched one unit ahead).", status=STATUS_INERT)
    pipeline_write: DSBool = F(False, doc="Overlap NVMe writes with compute (inert: writes are always "
                             "asynchronous).", status=STATUS_INERT)
    fast_init: DSBool = F(False, doc="Fast optimizer init with NVMe (inert).", status=STATUS_INERT)
    ratio: Number = F(1.0, ge=0, le=1, doc="Fraction of optimizer state offloaded (inert).",
                      status=STATUS_INERT)
    delayed_update: DSBool = F(False, doc="Our extension: ZeRO-Offload's delayed parameter update (DPU). After "
                             "`delayed_update_warmup_steps` optimizer steps, each step's update runs in the "
                             "background while the next forward/backward uses the weights from one step "
                             "earlier. Not with device \"nvme\".")
    delayed_update_warmup_steps: DSInt = F(10, ge=0, doc="Our extension: optimizer steps applied at once before "
                                           "DPU starts (the ZeRO-Offload paper warms up without delay).")


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param`: ZeRO-Infinity's parameter offload (stage 3): the 16-bit shards on
    the host or in a per-rank NVMe file, brought in just before their gather."""

    device: OffloadDevice = F("none", doc="Where the 16-bit parameter shards live between gathers: \"cpu\" "
                              "(host memory), \"nvme\" (a per-rank file under `nvme_path`, read ahead in "
                              "the recorded execution order). Stage 3 only; not with hpZ.")
    nvme_path: str | None = F(None, doc="Directory for the per-rank parameter file (required with device "
                              "\"nvme\").")
    pin_memory: DSBool = F(False, doc="On CUDA: page-locked host rows (as offload_optimizer.pin_memory; "
                         "either one turns it on). No effect for a model on the CPU.")
    buffer_count: DSInt = F(5, ge=1, doc="With device \"nvme\" (at least 2): how many shards may be in memory "
                            "at once (the unit being gathered, the prefetched gather, the shards read ahead).")
    buffer_size: DSInt = F(100_000_000, ge=1, doc="With device \"nvme\": elements per buffer; every unit's "
                           "shard on a rank must fit in one (checked at start-up).")
    max_in_cpu: DSInt = F(1_000_000_000, ge=0, doc="Elements kept in CPU memory with NVMe (inert).",
                          status=STATUS_INERT)


# --------------------------------------------------------------------------------------------------- ZeRO
class LocoConfig(Section):
    """`zero_optimization.zeropp_loco_param`: LoCo error feedback for qgZ (arXiv 2407.04480), DeepSpeed's keys.

    Before each qgZ hop quantizes, it adds the error it kept from the previous step; after quantizing it keeps
    ``err_beta * old + (1 - err_beta) * new`` error. Every ``reset_T`` optimizer steps the errors start from
    zero again. See Note [LoCo error feedback] in ``plus/loco.py``.
    """

    err_beta: Number = F(0.8, ge=0, lt=1, doc="Weight of the previous error in the moving average (DeepSpeed's "
                         "default 0.8); 0 keeps only the latest step's error.")
    reset_T: DSInt = F(1024, ge=1, doc="Optimizer steps after which the kept errors are zeroed (DeepSpeed's "
                       "default 1024).")


# DeepSpeed's defaults: mixture-of-experts blocks, whose experts run on some ranks only
DEFAULT_LEAF_CLASSES = ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]


class LeafModuleConfig(Section):
    """`zero_optimization.leaf_module`: modules whose whole subtree is gathered as one unit (DeepSpeed's keys)."""

    classes: list[str] = F(default_factory=lambda: list(DEFAULT_LEAF_CLASSES), doc="Class names, bare or with "
                           "their module path; DeepSpeed's default lists the mixture-of-experts blocks of Mixtral "
                           "and Qwen2/3-MoE.")
    names: list[str] = F(default_factory=list, doc="Module names as `model.named_modules()` gives them.")
    name_suffixes: list[str] = F(default_factory=list, doc="Suffixes of such names.")

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class ZeroConfig(Section):
    """`zero_optimization`: the ZeRO stage, its buckets, and the ZeRO++ switches (qwZ, hpZ, qgZ)."""

    stage: DSInt = F(0, doc="ZeRO stage: 0 plain data parallelism, 1 partitions optimizer state, 2 also "
                     "gradients, 3 also parameters.")
    reduce_bucket_size: DSInt | None = F(None, ge=0, doc="16-bit gradient elements held in buckets at once, "
                                         "as in DeepSpeed: two buckets of half, one reducing while backward fills "
                                         "the next (0 reduces each parameter on its own). Left out: a quarter of "
                                         "the trainable elements, within [1e6, 2e8] (docs/config.md, \"Buckets\").")
    allgather_bucket_size: DSInt = F(500_000_000, ge=1, doc="Stage 1/2 all-gather bucket size (even, as "
                                     "DeepSpeed requires).", status=STATUS_TUNING)
    stage3_prefetch_bucket_size: DSInt = F(50_000_000, ge=0, doc="Most elements one prefetch may gather (the "
                                           "next unit, one at a time); 0 turns prefetching off.")
    zeropp_coalesced_prefetch: DSBool = F(True, doc="Our extension (Note [gather groups]): over one hop, small "
                                          "units (at most 2^20 elements) are gathered in groups, one all-gather "
                                          "each, in the order the last passes gathered them (formed at each "
                                          "optimizer step): one collective's latency "
                                          "per group of thin blocks or LoRA adapters instead of per unit. Every "
                                          "such collective is padded to one length, so ranks that run different "
                                          "modules are refused by the collective order check, not aborted by "
                                          "the transport. false: one all-gather per unit.")
    stage3_param_persistence_threshold: DSInt = F(0, ge=0, doc="Stage 3: a gather unit of at most this many "
                                                  "elements stays gathered from its first use until the next "
                                                  "optimizer step (one gather per step instead of two per "
                                                  "micro-step). DeepSpeed's default is 1e5 per parameter; zeropp's "
                                                  "is 0 (docs/config.md, \"Persistence\").")
    stage3_model_persistence_threshold: DSInt = F(2**63 - 1, ge=0, doc="Stage 3: the most elements all "
                                                  "persistent units may hold together (units in model order).")
    stage3_module_granularity_threshold: DSInt = F(0, ge=0, doc="Stage 3: the outermost modules whose "
                                                   "parameters per layer are at most this become leaf modules, "
                                                   "gathered whole (DeepSpeed's rule; 0 is off).")
    stage3_max_live_parameters: DSInt = F(1_000_000_000, ge=0, doc="A prefetch starts only while the "
                                          "gathered, in-flight and prefetched elements stay within this.")
    stage3_max_reuse_distance: DSInt = F(1_000_000_000, ge=0, doc="Keep a gathered parameter if reused "
                                         "within this distance.", status=STATUS_TUNING)
    stage3_gather_16bit_weights_on_model_save: DSBool = F(False, doc="Gather full 16-bit weights when saving "
                                                        "the model: save_16bit_model always gathers them.")
    stage3_gather_fp16_weights_on_model_save: DSBool = F(False, doc="DeepSpeed's older name of "
                                                       "stage3_gather_16bit_weights_on_model_save.")
    overlap_comm: DSBool = F(True, doc="Overlap communication with compute; zeropp always overlaps.",
                           status=STATUS_TUNING)
    contiguous_gradients: DSBool = F(True, doc="Copy gradients into a contiguous buffer; zeropp always "
                                   "reduces into flat buffers.", status=STATUS_TUNING)
    reduce_scatter: DSBool = F(True, doc="Reduce-scatter gradients (true). `false` averages them with an "
                             "all-reduce of whole buckets, each rank keeping its part (twice the bytes).")
    allgather_partitions: DSBool = F(True, doc="All-gather vs. broadcasts in stage 1/2.", status=STATUS_TUNING)
    round_robin_gradients: DSBool = F(False, doc="Stage 1/2 CPU-offload copy ordering.", status=STATUS_TUNING)
    sub_group_size: DSInt = F(1_000_000_000, ge=0, doc="Optimizer offload to the host: the step's groups of at "
                              "most this many elements (0: one group).")
    ignore_unused_parameters: DSBool = F(True, doc="Stages 1-2: tolerate trainable parameters that get no gradient "
                                       "(false: each backward checks, and every rank raises naming them).")
    enable_sanity_checks: DSBool = F(False, doc="An in-place write inside GatheredParameters(modifier_rank=None): "
                                   "true raises on every rank for any write, as DeepSpeed checks; false (the default) "
                                   "raises for a write that changed a value and accepts one that wrote the values "
                                   "already there (DeepSpeed without the check loses every such write silently).")
    load_from_fp32_weights: DSBool = F(True, doc="Restore fp32 master weights from checkpoints; zeropp "
                                     "always does.", status=STATUS_TUNING)
    memory_efficient_linear: DSBool = F(True, doc="DeepSpeed replaces torch's linear under stage 3 so its "
                                      "saved weight is not kept gathered; zeropp patches nothing: a saved weight "
                                      "is released and gathered again when backward unpacks it.",
                                      status=STATUS_TUNING)
    elastic_checkpoint: DSBool = F(False, doc="DeepSpeed's stage 1/2 checkpoints that load on another world "
                                 "size; zeropp's checkpoints always do (re-sharding on load).", status=STATUS_TUNING)
    override_module_apply: DSBool = F(True, doc="DeepSpeed wraps module.apply under zero.Init to gather "
                                    "weights; zeropp initializes meta-built modules through param_init_fn.",
                                    status=STATUS_TUNING)
    use_multi_rank_bucket_allreduce: DSBool = F(True, doc="DeepSpeed's stage 1/2 all-reduce bucketing; zeropp "
                                              "reduce-scatters buckets.", status=STATUS_TUNING)
    log_trace_cache_warnings: DSBool = F(False, doc="DeepSpeed's warnings when its stage-3 trace changes; "
                                       "zeropp learns and checks its gather spans itself.", status=STATUS_TUNING)
    mics_shard_size: DSInt = F(-1, ge=-1, doc="MiCS: shard over groups of this size; -1 (off) is accepted, "
                               "other values are not supported yet.", status=STATUS_PARTIAL)
    zero_quantized_weights: DSBool = F(False, doc="qwZ: quantize weights for the forward all-gather.")
    zero_quantized_weights_bits: DSInt = F(8, doc="zeropp extension: qwZ bits per weight, 8 or 4.")
    zero_hpz_partition_size: DSInt = F(1, ge=1, doc="hpZ: ranks holding the secondary weight shard "
                                       "(1 = off; usually ranks per node).")
    zero_quantized_gradients: DSBool = F(False, doc="qgZ: quantized 2-hop all-to-all gradient reduction.")
    zero_quantized_gradients_bits: DSInt = F(4, doc="zeropp extension: qgZ bits per gradient, 2, 4 or 8 (2 "
                                             "in small blocks, e.g. 64; 1 is refused: symmetric block "
                                             "quantization has no 1-bit code).")
    quantization_block_size: DSInt = F(2048, doc="zeropp extension: elements per quantization block "
                                       "(even, >= 2).")
    gather_granularity: Literal["block", "module"] = F(
        "block", doc="Our extension, stage 3: \"block\" gathers each child of an nn.ModuleList (a transformer "
        "layer) as one unit, like FSDP2's per-block fully_shard (fewer, larger collectives); \"module\" gathers "
        "each module's own parameters separately (smallest peak of gathered weights).")
    zero_quantized_nontrainable_weights: DSBool = F(False, doc="Stage 3: keep parameters frozen at initialize "
                                                  "(`requires_grad=False`) only as int8 + scales (blocks of "
                                                  "`quantization_block_size`), gathered as int8 and dequantized "
                                                  "on arrival; no fp32 master, no 16-bit shard.")
    zeropp_loco_param: LocoConfig | None = F(None, doc="LoCo error feedback for qgZ: `{\"err_beta\": 0.8, "
                                             "\"reset_T\": 1024}` (see its section); needs "
                                             "`zero_quantized_gradients`.")
    pipeline_loading_checkpoint: DSBool = F(False, doc="DeepSpeed's stage-3 loading in which each node's ranks "
                                          "read the checkpoint one after another; zeropp's ranks read their own "
                                          "shards at once. Loading with it below stage 3 raises DeepSpeed's "
                                          "AssertionError under the alias.", status=STATUS_TUNING)
    offload_optimizer: OffloadOptimizerConfig | None = F(None, doc="Optimizer offload (see its section).")
    offload_param: OffloadParamConfig | None = F(None, doc="Parameter offload (see its section).")
    leaf_module: LeafModuleConfig = F(default_factory=LeafModuleConfig, doc="Stage 3: modules gathered as one "
                                      "unit with their whole subtree (see its section).")

    @field_validator("stage")
    @classmethod
    def _stage_range(cls, v: int) -> int:
        if v not in (0, 1, 2, 3):
            raise problem(f"must be 0, 1, 2 or 3, got {v}", "0, 1, 2 or 3")
        return v

    @field_validator("allgather_bucket_size")
    @classmethod
    def _allgather_alignment(cls, v: int) -> int:
        if v % 2:  # DeepSpeed's stage 1/2 asserts it (a multiple of its 2-element NCCL start alignment)
            raise problem(f"must be a multiple of 2 (DeepSpeed's alignment of 16-bit buckets), got {v}",
                          "an even number")
        return v

    @field_validator("zero_quantized_weights_bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (4, 8):
            raise problem(f"got {v} bits", "4 or 8")
        return v

    @field_validator("zero_quantized_gradients_bits")
    @classmethod
    def _grad_bits(cls, v: int) -> int:
        if v == 1:
            raise problem("got 1 bit: symmetric block quantization has no 1-bit code (its largest code is "
                          "2**(bits-1) - 1 = 0); sign compression would be another algorithm", "2, 4 or 8")
        if v not in (2, 4, 8):
            raise problem(f"got {v} bits", "2, 4 or 8")
        return v

    @model_validator(mode="after")
    def _loco_needs_qgz(self) -> ZeroConfig:
        if self.zeropp_loco_param is not None and not self.zero_quantized_gradients:
            raise problem("error feedback corrects qgZ's quantization, and zero_quantized_gradients is false",
                          "zero_quantized_gradients: true, or no zeropp_loco_param", path="zeropp_loco_param")
        return self

    @field_validator("quantization_block_size")
    @classmethod
    def _block(cls, v: int) -> int:
        if v < 2 or v % 2:
            raise problem(f"got {v}", "an even integer >= 2 (int4 packs two values per byte)")
        return v


class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`: DeepSpeed's settings for its ``deepspeed.checkpointing`` API.

    ``zeropp.activation.checkpointing.configure`` reads them (as DeepSpeed's does), and ``zeropp.initialize`` hands the
    section to it when the config has one. They apply to ``zeropp.activation.checkpointing.checkpoint`` and to Hugging
    Face models enabled through ``zeropp.activation.checkpointing.gradient_checkpointing_enable``; plain
    ``torch.utils.checkpoint`` ignores them.
    """

    partition_activations: DSBool | Literal["node"] = F(
        False, doc="true: DeepSpeed splits each checkpoint across the model-parallel group (whole with a group of "
        "one); zeropp has none, so checkpoints stay whole, as in DeepSpeed then (a ConfigWarning says so). "
        "\"node\" (our extension): each checkpoint input is split across the data-parallel ranks of the node, "
        "so a rank holds the node's mean of the checkpoint bytes instead of its own (less on the rank with the "
        "largest micro-batch when they differ; the same when they are alike), for 2 x (D-1)/D of the bytes "
        "over the node's link per step.")
    cpu_checkpointing: DSBool = F(False, doc="Keep the checkpoint inputs in host memory until the rerun (copied "
                                "through the host link, asynchronously on CUDA; nothing to copy on a CPU-only "
                                "run).")
    contiguous_memory_optimization: DSBool = F(False, doc="Copy checkpoint inputs into slots of one buffer "
                                             "per input size, preallocated with number_checkpoints slots.")
    number_checkpoints: DSInt | None = F(None, ge=1, doc="Checkpoint inputs held at once (slots of the "
                                         "contiguous buffer); required with contiguous_memory_optimization.")
    synchronize_checkpoint_boundary: DSBool = F(False, doc="torch.cuda.synchronize() before and after each "
                                              "checkpointed forward and rerun (no-op on the CPU).")
    profile: DSBool = F(False, doc="Time each checkpointed forward and rerun (logged; "
                      "zeropp.activation.checkpointing.timings()).")


_TAG_MODES = ("Ignore", "Warn", "Fail")


def _tag_mode(value: Any) -> Any:
    """DeepSpeed reads ``tag_validation`` in any case ("WARN", "warn"); the canonical spelling is kept."""
    if isinstance(value, str):
        for mode in _TAG_MODES:
            if value.upper() == mode.upper():
                return mode
        raise problem(f"got {_show(value)}", '"Ignore", "Warn" or "Fail" (in any case)')
    return value


class CheckpointParallelWriteConfig(Section):
    """`checkpoint.parallel_write`: DeepSpeed's parallel checkpoint writing across pipeline stages."""

    pipeline_stage: DSBool = F(False, doc="Write in parallel across pipeline stages; zeropp has no pipeline "
                               "parallelism, so `true` is not supported yet.", status=STATUS_PARTIAL)


class CheckpointWriterConfig(Section):
    """`checkpoint.writer`: DeepSpeed's FastPersist writer settings. zeropp writes each rank's shard itself (one
    safetensors file, fsync'd and published by a rename: docs/checkpoints.md), so they tune nothing here."""

    type: Literal["MOCK", "PYTHON", "FAST"] = F("FAST", doc="Which writer; \"MOCK\" (write nothing) is not "
                                                 "supported; \"PYTHON\" and \"FAST\" load and change nothing.",
                                                 status=STATUS_PARTIAL)
    io_buffer_size: DSInt = F(64 * 1024**2, ge=1, doc="FastPersist's I/O buffer bytes.", status=STATUS_TUNING)
    io_buffer_double: DSBool = F(True, doc="FastPersist's double buffering.", status=STATUS_TUNING)
    show_statistics: DSBool = F(False, doc="FastPersist's write statistics.", status=STATUS_TUNING)
    data_parallel: Literal["REPLICA", "SOCKET", "MACHINE"] | None = F(
        None, doc="Which data-parallel ranks write in FastPersist; every zeropp rank writes its own shard.",
        status=STATUS_TUNING)
    decoupled: DSBool = F(False, doc="FastPersist's writes in the background; zeropp's save returns once every "
                          "shard is on disk.", status=STATUS_TUNING)
    io_multiplier: DSInt = F(1, ge=1, doc="FastPersist's I/O multiplier.", status=STATUS_TUNING)

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class CheckpointConfig(Section):
    """`checkpoint`: DeepSpeed's settings for ``engine.save_checkpoint`` and ``load_checkpoint``."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = F(
        "Warn", doc="Whether save_checkpoint checks that every rank passed the same tag (one all-reduce): "
        "\"Fail\" raises an AssertionError, as DeepSpeed does; \"Warn\" and \"Ignore\" "
        "write one checkpoint under rank 0's tag, with a warning that names the tags (DeepSpeed would write "
        "each rank's files under its own tag, which no load reads whole). Any case is read (\"WARN\").")
    load_universal: DSBool = F(False, doc="`true`: load_checkpoint reads a universal checkpoint (the folder "
                               "`latest_universal` names; DeepSpeed's layout or zeropp's), on any world size and "
                               "stage (zeropp/deepspeed/checkpoint/universal_io.py).")
    use_node_local_storage: DSBool = F(False, doc="Each node saves to storage only it sees; `true` is not "
                                       "supported yet (rank 0 publishes one manifest over every rank's shard).",
                                       status=STATUS_PARTIAL)
    parallel_write: CheckpointParallelWriteConfig = F(default_factory=CheckpointParallelWriteConfig,
                                                      doc="Parallel writing across pipeline stages.",
                                                      status=STATUS_PARTIAL)
    checkpoint_serialization: DSBool = F(True, doc="torch.save's zipfile serialization in DeepSpeed; zeropp "
                                         "writes safetensors files.", status=STATUS_TUNING)
    writer: CheckpointWriterConfig | None = F(None, doc="DeepSpeed's FastPersist writer (see its section).",
                                              status=STATUS_PARTIAL)

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _mode(cls, v: Any) -> Any:
        return _tag_mode(v)


class AioConfig(Section):
    """`aio`: DeepSpeed's libaio settings for NVMe offload. zeropp's own asynchronous file I/O
    (`zeropp.offload.aio`: a pool of threads with 4 MiB staging buffers) does not use them."""

    block_size: DSInt = F(1_048_576, ge=1, doc="libaio request size; zeropp's I/O requests are 4 MiB.",
                          status=STATUS_TUNING)
    queue_depth: DSInt = F(8, ge=1, doc="libaio queue depth.", status=STATUS_TUNING)
    intra_op_parallelism: DSInt = F(1, ge=1, doc="libaio threads; zeropp uses 8 I/O threads.",
                                    status=STATUS_TUNING)
    thread_count: DSInt = F(1, ge=1, doc="The older name of intra_op_parallelism (current DeepSpeed no longer "
                            "reads it).", status=STATUS_TUNING)
    single_submit: DSBool = F(False, doc="Submit requests one by one.", status=STATUS_TUNING)
    overlap_events: DSBool = F(True, doc="Overlap request submission and completion.", status=STATUS_TUNING)
    use_gds: DSBool = F(False, doc="GPUDirect Storage; `true` is not supported yet.", status=STATUS_PARTIAL)


_DEEPCOMPILE = ("A DeepCompile option (DeepSpeed applies it only with deepcompile: true): its default is accepted, "
                "another value is not supported yet.")


class TensorParallelConfig(Section):
    """`tensor_parallel`: DeepSpeed's automatic tensor parallelism. zeropp partitions over data-parallel
    ranks only: a size above 1 is not supported."""

    autotp_size: DSInt = F(0, ge=0, doc="Tensor-parallel degree; 0 or 1 (off) is accepted, above 1 is not "
                           "supported yet.", status=STATUS_PARTIAL)


class DataTypesConfig(Section):
    """`data_types`: the dtype gradients accumulate in over an accumulation window (DeepSpeed's key)."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = F(
        None, doc="zeropp accumulates gradients in the training dtype (bf16, fp16 or fp32), and the value that "
        "names it loads; another one (fp32 accumulation under bf16, DeepSpeed's bf16 optimizer) is not "
        "supported yet.", status=STATUS_PARTIAL)


class CompileConfig(Section):
    """`compile`: torch.compile, in DeepSpeed's older form (`enabled`, `backend`, `kwargs`) and with 0.19's
    DeepCompile keys, of which zeropp has none (Note [compiled regions] in zeropp/zero/compiled.py)."""

    enabled: DSBool = F(False, doc="Compile the model at initialize, as engine.compile(backend, kwargs) does: "
                      "each block (a child of an nn.ModuleList) in place, else the whole model.")
    backend: str = F("inductor", doc="The torch.compile backend (\"inductor\", \"aot_eager\", ...); one torch "
                     "does not know is an error at initialize naming it.")
    kwargs: dict[str, Any] = F(default_factory=dict, doc="Other torch.compile keyword arguments (mode, "
                               "fullgraph, dynamic, options).")
    deepcompile: DSBool = F(False, doc="DeepSpeed's DeepCompile (ZeRO as compiler passes): not supported yet; "
                          "true is refused.", status=STATUS_PARTIAL)
    free_activation: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    free_activation_threshold: DSInt = F(10 * 1024 * 1024, ge=0, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    offload_activation: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    offload_activation_pin_memory: DSBool = F(True, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    offload_opt_states: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    double_buffer: DSBool = F(True, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    symmetric_memory: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    debug_log: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    offload_parameters: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    sync_before_reduce: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    sync_after_reduce: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    sync_before_allgather: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    sync_after_allgather: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    keep_int_input_tensors: DSBool = F(True, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    keep_all_input_tensors: DSBool = F(False, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)
    passes: list[str] | None = F(None, doc=_DEEPCOMPILE, status=STATUS_PARTIAL)


def deepcompile_keys() -> dict[str, Any]:
    """DeepCompile's keys of the `compile` section and their defaults (other values are not supported yet)."""
    return {name: f.default for name, f in CompileConfig.model_fields.items()
            if name not in ("enabled", "backend", "kwargs")}


class TopologyConfig(Section):
    """`topology` (zeropp extension): how ranks group into nodes for hpZ and qgZ."""

    ranks_per_node: DSInt | None = F(None, ge=1, doc="Ranks per node; null = torchrun's LOCAL_WORLD_SIZE. "
                                     "Set it smaller to simulate several nodes on one host.")


# ---------------------------------------------------------------------------------------------- optimizer
def _canonical(value: Any, names: tuple[str, ...]) -> Any:
    """Map a case-insensitive name to its canonical spelling (DeepSpeed lower-cases these names)."""
    if isinstance(value, str):
        for name in names:
            if value.lower() == name.lower():
                return name
    return value


def _typed_section_defaults(data: Any, known_types: tuple[str, ...]) -> Any:
    """Canonicalise a `{"type", "params"}` section's type spelling; `params` may be omitted (DeepSpeed)."""
    if isinstance(data, dict):
        data = {"params": {}, **data}
        if "type" in data:
            data["type"] = _canonical(data["type"], known_types)
    return data


ADAM_TYPES = ("Adam", "AdamW")
SGD_TYPES = ("SGD",)
OPTIMIZER_TYPES = ADAM_TYPES + SGD_TYPES
"""Optimizer types zeropp builds (torch.optim.Adam/AdamW/SGD)."""
UNBUILT_OPTIMIZERS = ("Adagrad", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion",
                             "MuAdam", "MuAdamW", "MuSGD", "Muon")
"""DeepSpeed optimizer types that are recognised but not supported yet."""


class AdamParams(Section):
    """`optimizer.params` for type Adam/AdamW (torch.optim.Adam / AdamW keyword arguments)."""

    lr: Number = F(1e-3, ge=0, doc="Learning rate (the peak rate when a scheduler is set).")
    betas: tuple[Number, Number] = F((0.9, 0.999), doc="Coefficients of the running averages [beta1, beta2].")
    eps: Number = F(1e-8, ge=0, doc="Term added to the denominator.")
    weight_decay: Number = F(0.0, ge=0, doc="Weight decay; decoupled (AdamW) unless Adam with "
                             "adam_w_mode false. Default 0 like DeepSpeed's FusedAdam, not torch's 0.01.")
    amsgrad: DSBool = F(False, doc="Use the AMSGrad variant.")
    maximize: DSBool = F(False, doc="Maximize the objective instead of minimizing.")
    foreach: DSBool | None = F(None, doc="torch's foreach implementation switch (null = torch decides).",
                             status=STATUS_TUNING)
    fused: DSBool | None = F(None, doc="torch's fused implementation switch (null: fused when every master "
                             "is on a GPU and foreach is not set, as DeepSpeed's FusedAdam; else torch decides).",
                           status=STATUS_TUNING)
    bias_correction: DSBool = F(True, doc="DeepSpeed FusedAdam key: `false` steps by lr * m / (sqrt(v) + eps) "
                              "without dividing the moments by 1 - beta**t (zeropp's UncorrectedAdam).")
    torch_adam: DSBool = F(False, doc="DeepSpeed key choosing torch's Adam over FusedAdam; zeropp always "
                         "uses torch's.", status=STATUS_TUNING)
    adam_w_mode: DSBool = F(True, doc="DeepSpeed key: for type Adam, true = decoupled weight decay "
                          "(AdamW), false = L2 (torch Adam). Type AdamW is always AdamW.")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v: Any) -> Any:
        return _pair(v)


class SGDParams(Section):
    """`optimizer.params` for type SGD (torch.optim.SGD keyword arguments)."""

    lr: Number = F(1e-3, ge=0, doc="Learning rate.")
    momentum: Number = F(0.0, ge=0, doc="Momentum factor.")
    dampening: Number = F(0.0, doc="Dampening for momentum.")
    weight_decay: Number = F(0.0, ge=0, doc="L2 penalty.")
    nesterov: DSBool = F(False, doc="Nesterov momentum (needs momentum > 0 and dampening 0).")
    maximize: DSBool = F(False, doc="Maximize the objective instead of minimizing.")
    foreach: DSBool | None = F(None, doc="torch's foreach switch.", status=STATUS_TUNING)
    fused: DSBool | None = F(None, doc="torch's fused switch.", status=STATUS_TUNING)

    @model_validator(mode="after")
    def _nesterov(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise problem("nesterov needs momentum > 0 and dampening 0", "momentum > 0 with dampening 0",
                          path="nesterov")
        return self


class OptimizerConfig(Section):
    """`optimizer`: `{"type": ..., "params": {...}}`; the type name is case-insensitive as in DeepSpeed."""

    type: str = F(doc="Adam, AdamW or SGD (case-insensitive).")
    params: Any = F(doc="Keyword arguments of the optimizer; keys depend on the type.")
    known_types: ClassVar[tuple[str, ...]] = OPTIMIZER_TYPES + UNBUILT_OPTIMIZERS

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        return _typed_section_defaults(data, cls.known_types)


class AdamOptimizerConfig(OptimizerConfig):
    """`optimizer` with type Adam or AdamW."""

    type: Literal["Adam", "AdamW"] = F(doc="Adam or AdamW.")
    params: AdamParams = F(default_factory=AdamParams, doc="Adam keyword arguments.")


class SGDOptimizerConfig(OptimizerConfig):
    """`optimizer` with type SGD."""

    type: Literal["SGD"] = F(doc="SGD.")
    params: SGDParams = F(default_factory=SGDParams, doc="SGD keyword arguments.")


class OtherOptimizerConfig(OptimizerConfig):
    """`optimizer` with a DeepSpeed-only type; it loads, then `check_supported` rejects it."""

    type: str = F(doc="A DeepSpeed optimizer type zeropp does not build yet.", status=STATUS_NOT_YET)
    params: dict[str, Any] = F(default_factory=dict, doc="Not validated.", status=STATUS_NOT_YET)

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in UNBUILT_OPTIMIZERS:
            raise problem(f"unknown optimizer type {v!r}", ", ".join(OPTIMIZER_TYPES) + " (case-insensitive)")
        return v


# ------------------------------------------------------------------------------------------ tagged unions
# Pydantic puts the tag into error locations; tags look like "<Adam>" so `zeropp.config` can drop them
# from the JSON paths it reports, and map them back to the model when it lists the accepted keys.
UNION_TAGS: dict[str, type[Section]] = {
    "<Adam>": AdamOptimizerConfig, "<SGD>": SGDOptimizerConfig, "<optimizer>": OtherOptimizerConfig,
}
"""The optimizer's tags; the scheduler's are `zeropp.config.scheduler.SCHEDULER_TAGS`."""


def _tagger(table: dict[str, str], fallback: str) -> Any:
    """A discriminator: the tag for a (case-insensitive) type name, else the catch-all model's tag."""

    def tag(value: Any) -> str:
        if isinstance(value, BaseModel):
            value = {"type": getattr(value, "type", None)}
        name = value.get("type") if isinstance(value, dict) else None
        return table.get(name.lower(), fallback) if isinstance(name, str) else fallback

    return tag


AnyOptimizerConfig = Annotated[
    Union[Annotated[AdamOptimizerConfig, Tag("<Adam>")], Annotated[SGDOptimizerConfig, Tag("<SGD>")],
          Annotated[OtherOptimizerConfig, Tag("<optimizer>")]],
    Discriminator(_tagger({"adam": "<Adam>", "adamw": "<Adam>", "sgd": "<SGD>"}, "<optimizer>")),
]
