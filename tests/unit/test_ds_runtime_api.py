"""DeepSpeed's runtime API as its scripts and its own tests (``tests/unit/runtime/``: ``test_ds_config_dict.py``,
``test_ds_initialize.py``, ``activation_checkpointing/``; ``tests/unit/checkpoint/``) use it, through the alias, in
one process and without an engine: the module paths, ``DeepSpeedConfig`` and ``DeepSpeedZeroConfig``, config files
(JSON, Hjson, relaxed JSON), the ``checkpoint`` section, ``initialize``'s argument checks, and activation
checkpointing's input and output cases. The engine's side is tests/dist/test_ds_runtime.py. Facts are DeepSpeed
0.19.8's (checked against it where its tests skip on CPU)."""
from __future__ import annotations

import argparse
import io
import json
from copy import deepcopy
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import zeropp
from zeropp.activation import checkpointing as core
from zeropp.config import ConfigError, ConfigWarning, NotSupportedError, load_config
from zeropp.config import relaxed_json
from zeropp.deepspeed.missing import DeepSpeedAPIError, is_missing

HIDDEN = 20


@pytest.fixture(autouse=True)
def fresh_checkpointing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with activation checkpointing unconfigured (module state is global)."""
    monkeypatch.setattr(core, "_settings", None)
    monkeypatch.setattr(core, "_warned", set())
    monkeypatch.setattr(core, "_deferred", None)
    yield
    core.reset()


# ---- module paths ----------------------------------------------------------------------------------------------
def test_the_module_paths_scripts_import_exist(alias, capsys) -> None:
    import deepspeed
    import deepspeed.runtime.activation_checkpointing.checkpointing as ds_ckpt
    from deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
    from deepspeed.runtime.config import ADAM_OPTIMIZER, DeepSpeedConfig, DeepSpeedConfigError
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.utils import see_memory_usage
    assert deepspeed.checkpointing is ds_ckpt and zeropp.checkpointing is ds_ckpt  # one module under both names
    assert callable(non_reentrant_checkpoint) and ADAM_OPTIMIZER == "adam"
    assert deepspeed.DeepSpeedConfig is DeepSpeedConfig and deepspeed.DeepSpeedConfigError is DeepSpeedConfigError
    assert zeropp.DeepSpeedConfigError is DeepSpeedConfigError and issubclass(DeepSpeedConfigError, ConfigError)
    assert get_model_ckpt_name_for_rank("/ck/global_step1", "00") == "/ck/global_step1/mp_rank_00_model_states.pt"
    assert get_zero_ckpt_name_for_rank("/ck", 1, 0) == "/ck/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert isinstance(FP16_UnfusedOptimizer, type)
    with pytest.raises(DeepSpeedAPIError, match="FP16_Optimizer"):
        FP16_Optimizer()
    for where, name in (("deepspeed", "DeepSpeedConfig"), ("deepspeed.checkpointing", "non_reentrant_checkpoint"),
                        ("engine", "checkpoint_tag_validation_enabled")):
        assert not is_missing(where, name), name
    see_memory_usage("not printed")  # DeepSpeed prints only with force=True
    see_memory_usage("post-init", force=True)
    out = capsys.readouterr().out
    assert "not printed" not in out and out.startswith("post-init\nMA ") and "CPU Virtual Memory:  used = " in out


def test_the_version_names_deepspeeds_test_checks(alias) -> None:
    import deepspeed
    for name in ("__git_hash__", "__git_branch__", "__version__", "__version_major__", "__version_minor__",
                 "__version_patch__"):
        assert hasattr(deepspeed, name), name
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == (0, 19, 8)
    assert deepspeed.__git_hash__ == "unknown"  # as DeepSpeed 0.19.8's wheel reports it


# ---- DeepSpeedConfig --------------------------------------------------------------------------------------------
def _run_batch_config(ds_config: Any, train_batch: Any = None, micro_batch: Any = None, gas: Any = None) -> bool:
    ds_config.train_batch_size = train_batch
    ds_config.train_micro_batch_size_per_gpu = micro_batch
    ds_config.gradient_accumulation_steps = gas
    try:
        ds_config._configure_train_batch_size()
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("batch,micro_batch,gas,success", [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False),
                                                            (32, 18, 1, False)])
def test_batch_sizes_complete_and_check_as_deepspeeds(alias, tmp_path: Path, batch: int, micro_batch: int, gas: int,
                                                      success: bool) -> None:
    """DeepSpeed's TestBatchConfig on 2 ranks: any two of the three give the third; a wrong triple asserts."""
    from deepspeed.runtime.config import DeepSpeedConfig
    path = tmp_path / "ds_batch_config.json"
    path.write_text(json.dumps({"train_batch_size": 2, "gradient_accumulation_steps": 1, "optimizer": {
        "type": "Adam", "params": {"lr": 0.00015}}, "gradient_clipping": 1.0, "fp16": {"enabled": True}}))
    ds_config = DeepSpeedConfig(str(path))
    assert (ds_config.train_micro_batch_size_per_gpu, ds_config.optimizer_name) == (2, "adam")  # world of 1 here
    ds_config.world_size = 2

    def check(status: bool) -> None:
        if not success:
            assert not status
            return
        assert status and (ds_config.train_batch_size, ds_config.train_micro_batch_size_per_gpu,
                           ds_config.gradient_accumulation_steps) == (batch, micro_batch, gas)

    check(_run_batch_config(ds_config, train_batch=batch, micro_batch=micro_batch, gas=gas))
    check(_run_batch_config(ds_config, train_batch=batch, micro_batch=micro_batch))
    if success:
        check(_run_batch_config(ds_config, train_batch=batch, gas=gas))
        check(_run_batch_config(ds_config, micro_batch=micro_batch, gas=gas))
        if gas == 1:
            check(_run_batch_config(ds_config, micro_batch=micro_batch))
            check(_run_batch_config(ds_config, train_batch=batch))
    else:
        check(_run_batch_config(ds_config, gas=gas))
        if gas != 1:
            check(_run_batch_config(ds_config, train_batch=batch, gas=gas))


def test_deepspeed_config_reads_deepspeeds_attributes(alias) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    for value, expected in (("mean", "mean"), ("SUM", "sum")):
        assert DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": value}).gradient_allreduce_op == \
            expected
    cfg = DeepSpeedConfig({"train_batch_size": 1, "checkpoint": {"tag_validation": "fail", "load_universal": True},
                           "zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}})
    assert cfg.gradient_allreduce_op == "mean" and cfg.zero_enabled and cfg.zero_optimization_stage == 2
    assert cfg.checkpoint_tag_validation_enabled and cfg.checkpoint_tag_validation_fail
    assert cfg.load_universal_checkpoint and not cfg.use_node_local_storage
    assert cfg.scheduler_name == "WarmupLR" and cfg.scheduler_params["warmup_num_steps"] == 1000
    assert cfg.optimizer_name is None and cfg.zero_config.stage == 2
    with pytest.raises(DeepSpeedConfigError, match="gradient_allreduce_op"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "max"})
    with pytest.raises(AssertionError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        DeepSpeedConfig({"gradient_accumulation_steps": 2})
    with pytest.raises(DeepSpeedAPIError, match="model and sequence parallelism"):
        DeepSpeedConfig({"train_batch_size": 1}, mpu=object())
    encoded = __import__("base64").urlsafe_b64encode(json.dumps({"train_batch_size": 3}).encode()).decode()
    assert DeepSpeedConfig(encoded).train_batch_size == 3  # DeepSpeed's third form of a config


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"])
def test_zero_config_has_deepspeeds_field_names(alias, key: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfigError
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    config = DeepSpeedZeroConfig(**{key: True})
    assert config.gather_16bit_weights_on_model_save is True
    assert not DeepSpeedZeroConfig(stage=3).gather_16bit_weights_on_model_save
    with pytest.warns(ConfigWarning, match="cpu_offload: DeepSpeed's deprecated flag"):
        more = DeepSpeedZeroConfig(stage=3, prefetch_bucket_size=7, stage3_max_live_parameters=9, cpu_offload=True)
    assert (more.prefetch_bucket_size, more.max_live_parameters, more.offload_optimizer.device) == (7, 9, "cpu")
    assert DeepSpeedZeroConfig(stage=3, pipeline_loading_checkpoint=True).pipeline_loading_checkpoint
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stag: unknown key"):
        DeepSpeedZeroConfig(stag=3)


def test_elastic_checkpoint_is_deprecated_for_zero3(alias, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's test, as written: the warning goes through ``deepspeed.utils.logger.warning``."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    messages: list[str] = []
    monkeypatch.setattr("deepspeed.utils.logger.warning", lambda message, *a, **k: messages.append(message))
    DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
    assert not messages  # stages 1-2: DeepSpeed's elastic checkpoints, which zeropp's always are
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert any("elastic checkpointing is deprecated" in str(m).lower() for m in messages)


# ---- config files and sections ---------------------------------------------------------------------------------
BASE = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "bf16": {"enabled": True}}
HJSON = """{
  # hjson.dump's form: quoteless strings, no commas
  train_batch_size: 1
  optimizer:
  {
    type: Adam
    params:
    {
      lr: 0.00015
    }
  }
  bf16:
  {
    enabled: true
  }
}
"""
RELAXED = """{
  // a comment
  train_batch_size: 1, # another
  "optimizer": {type: "Adam", params: {lr: 0.00015,},},
  /* a block
     comment */ bf16: {"enabled": true},
}
"""


def test_hjson_config_files_load_as_deepspeed_reads_them(tmp_path: Path) -> None:
    import hjson
    want = load_config(BASE)
    for name, text in (("config.hjson", HJSON), ("relaxed.json", RELAXED)):
        path = tmp_path / name
        path.write_text(text)
        assert load_config(path) == want, name
    buf = io.StringIO()
    hjson.dump(BASE, buf)  # what DeepSpeed's TestConfigLoad.test_hjson writes
    (tmp_path / "dumped.json").write_text(buf.getvalue())
    assert load_config(tmp_path / "dumped.json") == want
    (tmp_path / "dup.json").write_text("{train_batch_size: 1\ntrain_batch_size: 2}")
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(tmp_path / "dup.json")


def test_without_hjson_relaxed_json_loads_and_hjson_proper_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relaxed_json, "hjson_module", lambda: None)
    (tmp_path / "relaxed.json").write_text(RELAXED)
    assert load_config(tmp_path / "relaxed.json") == load_config(BASE)
    (tmp_path / "config.hjson").write_text(HJSON)
    with pytest.raises(ConfigError, match=r"config.hjson.*invalid JSON at line 4.*pip install hjson"):
        load_config(tmp_path / "config.hjson")
    text = '{"a": "x // not a comment", b: [1, 2,], "c#": 3}'  # comment marks inside strings stay
    assert json.loads(relaxed_json.relaxed_to_json(text)) == {"a": "x // not a comment", "b": [1, 2], "c#": 3}


def test_the_checkpoint_section_is_validated_and_refuses_what_zeropp_lacks_by_name() -> None:
    cfg = load_config({"checkpoint": {"tag_validation": "FAIL", "parallel_write": {"pipeline_stage": False},
                                      "writer": {"type": "python", "decoupled": True}},
                       "zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}})
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.checkpoint.writer.type == "PYTHON"
    assert cfg.zero_optimization.pipeline_loading_checkpoint and load_config({}).checkpoint.tag_validation == "Warn"
    with pytest.raises(ConfigError, match=r'tag_validation: got .foo.; accepted: "Ignore", "Warn" or "Fail"'):
        load_config({"checkpoint": {"tag_validation": "foo"}})
    with pytest.raises(NotSupportedError) as info:
        load_config({"checkpoint": {"use_node_local_storage": True, "parallel_write": {"pipeline_stage": True},
                                    "writer": {"type": "mock"}}})
    text = str(info.value)
    for key in ("checkpoint.use_node_local_storage", "checkpoint.parallel_write.pipeline_stage",
                "checkpoint.writer.type"):
        assert f"{key}: not supported yet" in text, key


# ---- initialize's argument checks (before any process group) -----------------------------------------------------
def test_initialize_checks_its_arguments_as_deepspeed(alias, tmp_path: Path) -> None:
    import deepspeed
    model = nn.Linear(2, 2)
    with pytest.raises(AssertionError, match="requires a model"):
        deepspeed.initialize(model=None, config=BASE)
    with pytest.raises(AssertionError, match="requires a model"):
        deepspeed.initialize(model, config=BASE)  # the model given as args
    with pytest.raises(AssertionError, match="given deepspeed configs in the deepspeed arguments"):
        deepspeed.initialize(args=argparse.Namespace(deepspeed_config="a.json"), model=model, config=BASE)
    both = argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json")
    with pytest.raises(AssertionError, match="both a deepscale_config and deepspeed_config"):
        deepspeed.initialize(args=both, model=model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.Adam(nn.Linear(2, 2).parameters()), lambda e: 1.0)
    for optimizer in (None, lambda params: torch.optim.AdamW(params)):  # TestClientLrScheduler's invalid pairs
        with pytest.raises(AssertionError, match="Client Optimizer .* is not instantiated but Client LR Scheduler"):
            deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=BASE)
    assert [p.shape for p in model.parameters()] == [torch.Size([2, 2]), torch.Size([2])]  # left as it was


# ---- activation checkpointing ----------------------------------------------------------------------------------
class MaskedLinear(nn.Linear):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * mask if mask.is_floating_point() else out * mask.type_as(out)


class MaskedLinearSeq(MaskedLinear):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple:  # type: ignore[override]
        return super().forward(x, mask), mask


class MaskedLinearSeqDup(MaskedLinearSeq):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple:  # type: ignore[override]
        dup = x.clone().detach() * 1.38
        x, mask = super().forward(x, mask)
        return dup, x, mask


class DropMaskLinear(nn.Linear):
    def forward(self, x: torch.Tensor, mask: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


class LinearNonTensorInput(nn.Linear):
    def forward(self, x: torch.Tensor, non_tensor_input: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


class LinearNonTensorOutput(nn.Linear):
    def __init__(self, non_tensor_output: Any) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.non_tensor_output = non_tensor_output

    def forward(self, x: torch.Tensor) -> tuple:  # type: ignore[override]
        return super().forward(x), self.non_tensor_output


def _mask(floating: bool) -> torch.Tensor:
    torch.manual_seed(1)
    mask = torch.randn(HIDDEN) > 0
    return mask.float() if floating else mask


def _compute(ckpt: Any, module: nn.Module, *inputs: Any) -> dict:
    outputs = ckpt(module, *inputs) if ckpt is not None else module(*inputs)
    outputs = (outputs,) if torch.is_tensor(outputs) else outputs
    sum(o.sum() for o in outputs if torch.is_tensor(o) and o.requires_grad).backward()
    return {"outputs": outputs, "module_grads": [p.grad for p in module.parameters()],
            "input_grads": [i.grad for i in inputs if torch.is_tensor(i)]}


def _match(ref: Any, tgt: Any) -> None:
    assert type(ref) is type(tgt)
    if isinstance(ref, (list, tuple)):
        assert len(ref) == len(tgt)
        for x, y in zip(ref, tgt):
            _match(x, y)
    elif not torch.is_tensor(ref):
        assert ref == tgt
    elif ref.is_floating_point():
        assert torch.allclose(ref, tgt)
    else:
        assert torch.equal(ref, tgt)


def _check_against_plain(ckpt: Any, module: nn.Module, *inputs: Any) -> None:
    """DeepSpeed's ``_test_activation_checkpoint``: outputs, module and input gradients as without checkpointing."""
    module.eval()
    base = _compute(None, deepcopy(module), *deepcopy(inputs))
    test = _compute(ckpt, deepcopy(module), *deepcopy(inputs))
    for group in base:
        assert len(base[group]) == len(test[group]), group
        for b, t in zip(base[group], test[group]):
            _match(b, t)


def _grad_input() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.rand(HIDDEN, requires_grad=True)


def _modules_and_inputs(mask: torch.Tensor, with_grad: bool) -> list[tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    x = torch.rand(HIDDEN, requires_grad=with_grad)
    return [(nn.Linear(HIDDEN, HIDDEN), (x,)), (MaskedLinear(HIDDEN, HIDDEN), (x, mask)),
            (MaskedLinearSeq(HIDDEN, HIDDEN), (x, mask)), (MaskedLinearSeqDup(HIDDEN, HIDDEN), (x, mask)),
            (DropMaskLinear(HIDDEN, HIDDEN), (x, None))]


@pytest.mark.parametrize("floating_mask", [False, True])
@pytest.mark.parametrize("which", ["checkpoint", "non_reentrant_checkpoint"])
def test_checkpoint_inputs_and_outputs_as_deepspeeds_cases(alias, which: str, floating_mask: bool) -> None:
    """TestActivationCheckpoint (inputs 1-2, outputs 1-3, a None argument), and for the non-reentrant form also
    TestActivationCheckpointWithoutGrad (no input needs a gradient; the parameters do)."""
    import deepspeed.runtime.activation_checkpointing.checkpointing as ds_ckpt
    ckpt = getattr(ds_ckpt, which)
    for module, inputs in _modules_and_inputs(_mask(floating_mask), with_grad=True):
        _check_against_plain(ckpt, module, *inputs)
    if which == "non_reentrant_checkpoint":
        for module, inputs in _modules_and_inputs(_mask(floating_mask), with_grad=False):
            _check_against_plain(ckpt, module, *inputs)


NON_TENSORS = [None, 2, True, (None, 2.5), (None, True, torch.randn(HIDDEN))]


@pytest.mark.parametrize("non_tensor", NON_TENSORS)
def test_checkpoint_non_tensor_inputs_and_outputs_keep_their_order(alias, non_tensor: Any) -> None:
    """TestCheckpointNonTensor and TestCheckpointNonTensorOutputOrdering."""
    import deepspeed
    ckpt = deepspeed.checkpointing.checkpoint
    _check_against_plain(ckpt, LinearNonTensorInput(HIDDEN, HIDDEN), _grad_input(), non_tensor)
    _check_against_plain(ckpt, LinearNonTensorOutput(non_tensor), _grad_input())
    outputs = _compute(ckpt, LinearNonTensorOutput(non_tensor), _grad_input())["outputs"]
    got = [torch.is_tensor(t) for item in outputs for t in (item if isinstance(item, (list, tuple)) else [item])]
    tail = non_tensor if isinstance(non_tensor, tuple) else (non_tensor,)
    assert got == [True] + [torch.is_tensor(t) for t in tail]


def test_checkpoint_keyword_arguments_are_differentiated(alias) -> None:
    import deepspeed

    def function(value: torch.Tensor, *, scale: torch.Tensor, offset: float) -> torch.Tensor:
        return value * scale + offset

    value, scale = torch.randn(HIDDEN, requires_grad=True), torch.randn(HIDDEN, requires_grad=True)
    ref_value, ref_scale = value.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    reference = function(ref_value, scale=ref_scale, offset=1.5)
    reference.sum().backward()
    output = deepspeed.checkpointing.checkpoint(function, value, scale=scale, offset=1.5)
    output.sum().backward()
    torch.testing.assert_close(output, reference)
    torch.testing.assert_close(value.grad, ref_value.grad)
    torch.testing.assert_close(scale.grad, ref_scale.grad)


_GLOBALS = ("PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "num_layers", "CPU_CHECKPOINT", "SYNCHRONIZE",
            "PROFILE_TIME", "mpu", "deepspeed_checkpointing_enabled")


@pytest.mark.filterwarnings("ignore:activation_checkpointing.partition_activations")
def test_configure_refuses_contiguous_checkpointing_without_a_count_and_the_globals_restore(alias) -> None:
    """DeepSpeed 0.19.8's regression test: the assertion fires at the call (DeepSpeed's module globals, which its
    tests save and put back, are views of the settings here)."""
    import deepspeed
    cp = deepspeed.checkpointing
    saved = {name: getattr(cp, name) for name in _GLOBALS}
    assert saved == {"PARTITION_ACTIVATIONS": False, "CONTIGUOUS_CHECKPOINTING": False, "num_layers": None,
                     "CPU_CHECKPOINT": False, "SYNCHRONIZE": False, "PROFILE_TIME": False, "mpu": None,
                     "deepspeed_checkpointing_enabled": False}
    with pytest.raises(AssertionError, match="number of layers"):
        cp.configure(mpu_=None, partition_activations=True, contiguous_checkpointing=True)
    cp.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3,
                 profile=True)
    assert (cp.CONTIGUOUS_CHECKPOINTING, cp.num_layers, cp.PROFILE_TIME, cp.deepspeed_checkpointing_enabled) == \
        (True, 3, True, True)
    cp.CPU_CHECKPOINT = True  # a global written is that setting
    assert core.settings().cpu_checkpointing
    for name, value in saved.items():
        setattr(cp, name, value)
    assert {name: getattr(cp, name) for name in _GLOBALS} == saved and not cp.is_configured()
    with pytest.raises(DeepSpeedAPIError, match="model parallelism"):
        cp.mpu = object()


def test_initialize_takes_contiguous_checkpointing_without_a_count_and_checkpoints_run(alias) -> None:
    """What DeepSpeed accepts: its initialize never applies the section, so checkpoints run; zeropp applies the rest
    of it and leaves the contiguous buffer off until configure gives the count."""
    import deepspeed
    with pytest.warns(ConfigWarning) as caught:
        core.apply_config({"train_batch_size": 1, "activation_checkpointing": {
            "contiguous_memory_optimization": True, "profile": True}})
    assert any("no number_checkpoints" in str(w.message) for w in caught)
    assert deepspeed.checkpointing.PROFILE_TIME and not deepspeed.checkpointing.CONTIGUOUS_CHECKPOINTING
    _check_against_plain(deepspeed.checkpointing.checkpoint, nn.Linear(HIDDEN, HIDDEN), _grad_input())
    assert core.timings()["forward"]["count"] == 1 and not core.buffer_bytes()
