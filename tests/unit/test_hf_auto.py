"""zeropp.hf's "auto" values against a real ``transformers.TrainingArguments``: the values Hugging Face's
DeepSpeed integration fills in, the Trainer-owned keys, mismatches named on both sides, the settings
ZeroppTrainer refuses, and the extra's import error without transformers."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from zeropp.config import load_config  # noqa: E402
from zeropp.hf import (  # noqa: E402
    TrainerConfigMismatch,
    ZeroppTrainer,
    ZeroppTrainerError,
    auto_values,
    hidden_size_of,
    trainer_config,
    unsupported_arguments,
)
from zeropp.hf.values import check_trainer_owned  # noqa: E402

HF_STAGE3 = {  # the shape of transformers' tests/deepspeed/ds_config_zero3.json, with WarmupDecayLR
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


@pytest.fixture(scope="module")
def args(tmp_path_factory: pytest.TempPathFactory) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("args")), per_device_train_batch_size=4,
                             gradient_accumulation_steps=3, learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95,
                             adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=0.1,
                             bf16=True, use_cpu=True, report_to=[])


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=48, n_layer=1, n_head=4))


def test_auto_values_are_what_hugging_face_fills_in(args: TrainingArguments, model: GPT2LMHeadModel) -> None:
    values = auto_values(args, model, num_training_steps=50)
    assert values.given == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        "train_batch_size": 12,  # world size 1 in this process
        "gradient_clipping": 0.5,
        "optimizer.params.lr": 2e-4,
        "optimizer.params.betas": [0.8, 0.95],
        "optimizer.params.eps": 1e-6,
        "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 2e-4,
        "scheduler.params.total_num_steps": 50,
        "scheduler.params.warmup_num_steps": 5,  # warmup_steps=0.1 is a ratio: ceil(0.1 * 50)
        "fp16.enabled": False,
        "bf16.enabled": True,
    }
    assert values.hidden_size == 48  # GPT-2's n_embd, read as config.hidden_size


def test_the_whole_hf_config_resolves(args: TrainingArguments, model: GPT2LMHeadModel) -> None:
    cfg = load_config(HF_STAGE3, auto_values(args, model, num_training_steps=50))
    assert cfg.resolve_batch(1) == (12, 4, 3)
    assert cfg.bf16.enabled and not cfg.fp16.enabled and cfg.gradient_clipping == 0.5
    p = cfg.optimizer.params
    assert (p.lr, tuple(p.betas), p.eps, p.weight_decay) == (2e-4, (0.8, 0.95), 1e-6, 0.1)
    s = cfg.scheduler.params
    assert (s.warmup_min_lr, s.warmup_max_lr, s.warmup_num_steps, s.total_num_steps) == (0, 2e-4, 5, 50)
    assert cfg.zero_optimization.reduce_bucket_size == 48 * 48


def test_without_the_step_count_the_schedule_length_stays_unresolved(args: TrainingArguments) -> None:
    values = auto_values(args)
    assert "scheduler.params.total_num_steps" not in values.given and values.hidden_size is None
    assert auto_values(args, num_training_steps=3).given["scheduler.params.warmup_num_steps"] == 1  # never 0


def test_hidden_size_follows_hugging_faces_rule() -> None:
    class Cfg:
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    class Model:
        def __init__(self, config: object) -> None:
            self.config = config

    assert hidden_size_of(Model(Cfg(hidden_sizes=[32, 96, 64]))) == 96
    assert hidden_size_of(Model(Cfg(text_config=Cfg(hidden_size=40)))) == 40
    assert hidden_size_of(Model(Cfg())) is None and hidden_size_of(None) is None


def test_trainer_owned_keys_left_out_take_the_arguments(args: TrainingArguments, model: GPT2LMHeadModel) -> None:
    values = auto_values(args, model, 50)
    tree = trainer_config({"zero_optimization": {"stage": 3}}, values)
    assert tree["train_micro_batch_size_per_gpu"] == 4 and tree["gradient_accumulation_steps"] == 3
    assert tree["gradient_clipping"] == 0.5 and tree["bf16"] == {"enabled": True}
    assert "fp16" not in tree  # a precision section is only added to switch it on
    assert "optimizer" not in tree  # not Trainer-owned: without a section, the Trainer's own optimizer is used
    check_trainer_owned(load_config(tree), values, world_size=1)


def test_explicit_values_that_contradict_the_arguments_are_named(args: TrainingArguments) -> None:
    raw = {**HF_STAGE3, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "fp16": {"enabled": True}, "bf16": {"enabled": False},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.95]}}}
    with pytest.raises(TrainerConfigMismatch) as err:
        trainer_config(raw, auto_values(args, None, 50))
    msg = str(err.value)
    assert "gradient_accumulation_steps: 2 in the config, but TrainingArguments gradient_accumulation_steps gives 3" \
        in msg
    assert "gradient_clipping: 1.0 in the config, but TrainingArguments max_grad_norm gives 0.5" in msg
    assert "fp16.enabled: True in the config, but TrainingArguments fp16 gives False" in msg
    assert "bf16.enabled: False in the config, but TrainingArguments bf16 gives True" in msg
    assert "optimizer.params.lr: 0.001 in the config, but TrainingArguments learning_rate gives 0.0002" in msg
    assert "betas" not in msg  # equal values (a list either way) are no mismatch


def test_an_older_spelling_cannot_slip_a_precision_past_the_arguments(args: TrainingArguments) -> None:
    values = auto_values(args, None, 50)
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
                       "gradient_clipping": 0.5, "fp16": {"enabled": True}})
    with pytest.raises(TrainerConfigMismatch, match="bf16.enabled: False in the config, but TrainingArguments bf16"):
        check_trainer_owned(cfg, values, world_size=1)


@pytest.mark.parametrize("setting, name", [
    ({"fsdp": "full_shard"}, "fsdp"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ({"save_on_each_node": True}, "save_on_each_node"),
])
def test_settings_that_cannot_work_name_the_argument(tmp_path, setting: dict, name: str) -> None:
    bad = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for key, value in setting.items():
        object.__setattr__(bad, key, value)  # set after construction: some need packages this machine lacks
    problems = unsupported_arguments(bad)
    assert len(problems) == 1 and problems[0].startswith(f"{name}:")
    with pytest.raises(ZeroppTrainerError, match=name):
        ZeroppTrainer(model=GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2)), args=bad,
                      zeropp_config={"zero_optimization": {"stage": 3}})


def test_the_config_is_required(args: TrainingArguments) -> None:
    with pytest.raises(TypeError, match="zeropp_config"):
        ZeroppTrainer(model=GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2)), args=args)


def test_training_arguments_deepspeed_is_the_config_given_once_through_the_alias(tmp_path) -> None:
    """Note [one engine, two roads]: TrainingArguments.deepspeed is the config (tests/dist/test_deepspeed_road.py
    trains so); given twice, or without the alias installed, it is refused by name."""
    road = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    object.__setattr__(road, "deepspeed", {"zero_optimization": {"stage": 3}})  # this machine has no DeepSpeed
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2))
    assert unsupported_arguments(road) == []
    with pytest.raises(ZeroppTrainerError, match="given twice, as TrainingArguments.deepspeed and as zeropp_config"):
        ZeroppTrainer(model=model, args=road, zeropp_config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ZeroppTrainerError, match="install_deepspeed_alias"):
        ZeroppTrainer(model=model, args=road)


def test_without_transformers_the_extra_is_named() -> None:
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import zeropp.hf\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'zeropp[hf]'" in out.stdout, out.stdout + out.stderr
