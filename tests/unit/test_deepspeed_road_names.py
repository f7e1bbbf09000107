"""The DeepSpeed names accelerate, transformers and TRL reach on their DeepSpeed road, through the alias:
``runtime.lr_schedules``, ``checkpoint.utils.clone_tensors_for_torch_save``, ``accelerator.get_accelerator``,
``ops.adam.DeepSpeedCPUAdam``, accelerate's ``steps_per_print: inf`` and ``engine.config.get``."""
from __future__ import annotations

import math

import pytest
import torch

from zeropp.config import ConfigError, load_config
from zeropp.config.policy import resolve
from zeropp.deepspeed.missing import DeepSpeedAPIError


def test_lr_schedules_names_deepspeeds_schedules_and_builds_zeropps(alias):
    import deepspeed
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupDecayLR
    from zeropp.optim import WarmupDecayLR as ours
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES is VALID_LR_SCHEDULES  # accelerate's spelling
    assert WarmupDecayLR is ours
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_max_lr=0.5, warmup_num_steps=2, warmup_type="linear")
    assert type(sched).__name__ in VALID_LR_SCHEDULES
    import zeropp.optim
    # every name DeepSpeed lists is a schedule zeropp builds (tests/unit/test_lr_schedules.py checks their values)
    assert all(getattr(deepspeed.runtime.lr_schedules, name) is getattr(zeropp.optim, name)
               for name in VALID_LR_SCHEDULES)


def test_clone_tensors_for_torch_save_gives_each_tensor_its_own_storage(alias):
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    big = torch.arange(1000.0)
    tree = {"w": big[10:14], "nested": [big[:2], (big[5:6], 3)], "n": "text"}
    out = clone_tensors_for_torch_save(tree)
    assert torch.equal(out["w"], big[10:14]) and out["w"].untyped_storage().nbytes() == 4 * 4
    assert out["nested"][0].untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert isinstance(out["nested"][1], tuple) and out["nested"][1][1] == 3 and out["n"] == "text"


def test_get_accelerator_names_this_processs_device(alias):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc is deepspeed.get_accelerator() and acc.is_available()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.device_name() == want and acc.current_device_name().startswith(want)
    assert acc.communication_backend_name() == ("nccl" if want == "cuda" else "gloo")
    with pytest.raises(DeepSpeedAPIError, match="get_accelerator\\(\\).pin_memory"):
        acc.pin_memory(torch.zeros(1))


def test_deepspeed_cpu_adam_steps_as_torch_adamw(alias):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64)), None
    b = torch.nn.Parameter(a.detach().clone())
    ours = DeepSpeedCPUAdam([a], lr=1e-2, weight_decay=0.1, adamw_mode=True)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for step in range(3):
        g = torch.randn(64, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for bad in ({"bias_correction": False}, {"amsgrad": True}, {"fp32_optimizer_states": False}):
        with pytest.raises(DeepSpeedAPIError, match=next(iter(bad))):
            DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))], **bad)


def test_accelerates_steps_per_print_inf_means_never():
    cfg = load_config({"train_batch_size": 4, "steps_per_print": math.inf, "wall_clock_breakdown": True})
    assert cfg.steps_per_print == 2**63 - 1
    assert resolve(cfg, 1, torch.nn.Linear(2, 2)).print_every == 2**63 - 1  # never reached
    for bad in (-math.inf, math.nan, 2.5):
        with pytest.raises(ConfigError, match="steps_per_print"):
            load_config({"train_batch_size": 4, "steps_per_print": bad})


def test_the_config_answers_get_as_deepspeeds_engine_config_does():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3}})
    assert cfg.get("zero_optimization", {}).get("stage") == 3  # transformers' save_model reads it so
    assert cfg.get("train_batch_size") == 4 and cfg.get("no_such_key", "x") == "x"
    assert isinstance(cfg.get("bf16"), dict)


def test_trls_dotted_top_level_keys_are_set_aside_as_deepspeed_ignores_them():
    with pytest.warns(UserWarning, match="zero_optimization.reduce_bucket_size: ignored: a dotted key"):
        cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3},
                           "zero_optimization.reduce_bucket_size": 100})
    assert cfg.zero_optimization.reduce_bucket_size is None  # the section's own value, not the dotted key's


@pytest.mark.parametrize("launcher", [["-m", "zeropp.tools.run"], ["-m", "zeropp.tools.cli", "run"]])
def test_the_launcher_installs_the_alias_before_the_script_imports_transformers(tmp_path, launcher):
    import json
    import subprocess
    import sys
    script = tmp_path / "recipe.py"
    script.write_text("import json, sys\nfrom transformers.integrations import is_deepspeed_available\n"
                      "import deepspeed\nprint(json.dumps({'argv': sys.argv, 'deepspeed': deepspeed.__name__, "
                      "'available': is_deepspeed_available(), 'main': __name__}))\n")
    proc = subprocess.run([sys.executable, *launcher, str(script), "--deepspeed", "ds.json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"argv": [str(script), "--deepspeed", "ds.json"], "deepspeed": "zeropp.deepspeed",
                   "available": True, "main": "__main__"}
    assert "zeropp run: " in proc.stderr


@pytest.mark.parametrize("launcher", [["-m", "zeropp.tools.run"], ["-m", "zeropp.tools.cli", "run"]])
def test_processes_started_under_the_launcher_have_the_alias_and_commands_are_found(tmp_path, launcher):
    """A Python process the script starts (as ``accelerate launch`` starts its ranks) installs the alias at start
    (``tools/boot/sitecustomize.py``); a command on PATH runs in place of a script; others are refused by name."""
    import json
    import os
    import subprocess
    import sys
    script = tmp_path / "parent.py"
    script.write_text("import subprocess, sys\nsubprocess.run([sys.executable, '-c', \"import sys, json; "
                      "print(json.dumps(getattr(sys.modules.get('deepspeed'), '__name__', None)))\"], check=True)\n")
    proc = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == "zeropp.deepspeed"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "pytool").write_text(f"#!{sys.executable}\nimport sys, deepspeed\nprint(deepspeed.__name__, sys.argv[1:])\n")
    (bindir / "shtool").write_text("#!/bin/sh\necho hi\n")
    for tool in ("pytool", "shtool"):
        (bindir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    ok = subprocess.run([sys.executable, *launcher, "pytool", "a"], capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and ok.stdout.strip() == "zeropp.deepspeed ['a']", ok.stderr[-2000:]
    for name, why in (("shtool", "is not a Python script"), ("no-such-tool", "no script or command 'no-such-tool'")):
        bad = subprocess.run([sys.executable, *launcher, name], capture_output=True, text=True, timeout=120, env=env)
        assert bad.returncode != 0 and why in bad.stderr, bad.stderr[-2000:]


def test_a_saved_weight_answers_ds_status_in_a_custom_backward(alias):
    """Note [saved weights' ds_status]: with stage 3's saved-tensor hooks a custom function's backward gets a
    plain tensor for the weight it saved; it answers ``ds_status`` (TRL's fused LM-head loss reads it), other
    tensors still have no such attribute, and uninstalling the alias takes the name away."""
    import torch.distributed as dist

    import deepspeed
    from zeropp.deepspeed.alias import install_deepspeed_alias, uninstall_deepspeed_alias
    from zeropp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    seen = []

    class Head(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w):  # noqa: ANN001, ANN205
            ctx.save_for_backward(h, w)
            return h @ w.t()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            h, w = ctx.saved_tensors
            seen.append((type(w), w.ds_status))
            return g @ w, g.t() @ h

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 3, bias=False)

        def forward(self, x):  # noqa: ANN001, ANN201
            return Head.apply(self.body(x), self.head.weight).pow(2).sum()  # the head's weight read directly

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29677", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=Net(), config={"train_micro_batch_size_per_gpu": 2,
                                                              "zero_optimization": {"stage": 3}})
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
        assert seen and seen[0] == (torch.Tensor, ZeroParamStatus.AVAILABLE)
        assert not hasattr(torch.zeros(2), "ds_status")
        engine.destroy()
    finally:
        if created:
            dist.destroy_process_group()
    uninstall_deepspeed_alias()
    assert "ds_status" not in vars(torch.Tensor)
    install_deepspeed_alias()  # the fixture uninstalls it again


def test_names_deepspeeds_own_tests_reach(alias):
    """``deepspeed.runtime.zero.unwrap_model_for_generation``, ``param.ds_summary()``, DeepSpeed's
    ``partitioned_param_data_shape`` (its [0]; zeropp keeps full shapes) and ``BF16_Optimizer``, which can be
    imported, patched and tested against, never matches zeropp's optimizer and refuses to be built by name."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.runtime.zero import unwrap_model_for_generation
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation as in_stage3
    assert unwrap_model_for_generation is in_stage3
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.partition_parameters import partitioned_param_data_shape
    assert partitioned_param_data_shape == [0]
    with pytest.raises(DeepSpeedAPIError, match="BF16_Optimizer.*engine.optimizer"):
        BF16_Optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    assert callable(BF16_Optimizer.destroy)  # scripts wrap it (a safe destroy for accelerate's DummyOptim)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29678", rank=0, world_size=1)
    try:
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 3), config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
        assert not isinstance(engine.optimizer, BF16_Optimizer)
        summary = engine.module.weight.ds_summary()
        assert summary == {"id": 0, "status": "NOT_AVAILABLE", "numel": 12, "ds_numel": 12, "shape": (3, 4),
                           "ds_shape": (3, 4), "requires_grad": True, "grad_shape": None, "persist": False,
                           "ds_tensor.shape": (12,)}
        engine.destroy()
    finally:
        if created:
            dist.destroy_process_group()
