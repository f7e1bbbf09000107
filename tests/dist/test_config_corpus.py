"""The public config corpus (tests/data/configs, sources in SOURCES.md): every file loads, and each one
trains a tiny GPT-2 from ``transformers`` for two optimizer steps on 2 nodes x 2 ranks.

A config is used as its authors wrote it. Hugging Face's ``"auto"`` values are filled in from a
``TrainingArguments`` as the Trainer fills them (``zeropp.hf.auto_values``), and a config with no batch key
at all (written for a Trainer, which always passes one) gets the Trainer's micro-batch. Two values describe
the machine rather than the training and are set for this one: ``nvme_path`` (a temporary directory) and
``zero_hpz_partition_size`` above 1 (the tutorial's 16 GPUs per node; here a node has 2 ranks).
The two files under ``refused/`` ask for what zeropp does not have and must say so by name.
"""
from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

import zeropp
from support.hf_models import gpt2, hf_batch, hf_loss
from support.world import run_world
from zeropp.config import ConfigWarning, NotSupportedError, load_config

CORPUS = Path(__file__).resolve().parents[1] / "data" / "configs"
FILES = sorted(p.name for p in CORPUS.glob("*.json"))
RANKS_PER_NODE, STEPS, MAX_STEPS, MICRO = 2, 2, 12, 2
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _for_this_machine(raw: dict, scratch: str) -> dict:
    raw = copy.deepcopy(raw)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(key), dict) and zero[key].get("nvme_path"):
                zero[key]["nvme_path"] = scratch
        if zero.get("zero_hpz_partition_size", 1) > 1:
            zero["zero_hpz_partition_size"] = RANKS_PER_NODE
    raw["topology"] = {"ranks_per_node": RANKS_PER_NODE}
    if not any(k in raw for k in BATCH_KEYS):  # written for a Trainer, which always passes its batch size
        raw["train_micro_batch_size_per_gpu"] = MICRO
    return raw


def _training_args(scratch: str):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=scratch, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1,
                             learning_rate=1e-3, max_grad_norm=1.0, warmup_steps=1, bf16=True, use_cpu=True,
                             report_to=[])


def train_each(rank: int, world: int, names: list[str], scratch: str) -> dict:
    """Two applied optimizer steps per config (fp16 configs may skip early steps while the scale settles)."""
    from zeropp.hf import auto_values
    args = _training_args(scratch)
    out = {}
    for name in names:
        raw = _for_this_machine(json.loads((CORPUS / name).read_text()), scratch)
        torch.manual_seed(0)
        model = gpt2()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            cfg = load_config(raw, auto_values(args, model, num_training_steps=STEPS))
        engine, *_ = zeropp.initialize(model=model, config=cfg)
        before = engine.consolidated_state_dict()
        micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        losses, lrs, applied, micro_step = [], [], 0, 0
        while applied < STEPS and engine.global_steps < MAX_STEPS:
            x, y = hf_batch(micro_step, micro * world)
            loss = hf_loss(engine, x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
            engine.backward(loss)
            lr = max(engine.get_lr())  # what this optimizer step uses (WarmupLR starts at warmup_min_lr)
            engine.step()
            losses.append(loss.item())
            micro_step += 1
            if micro_step % gas == 0 and not engine.was_step_skipped():
                applied += 1
                lrs.append(lr)
        after = engine.consolidated_state_dict()
        engine.close()
        out[name] = {"losses": losses, "applied": applied, "gas": gas, "stage": engine.zero_optimization_stage(),
                     "changed": sum(not torch.equal(before[k], after[k]) for k in before), "params": len(before),
                     "lrs": lrs}
    return out


@pytest.fixture(scope="module")
def corpus_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    scratch = str(tmp_path_factory.mktemp("corpus"))
    return run_world(train_each, 4, FILES, scratch, ranks_per_node=RANKS_PER_NODE, timeout=900)[0]


def test_the_corpus_is_large_and_every_file_is_json() -> None:
    assert len(FILES) >= 15
    for name in FILES:
        assert isinstance(json.loads((CORPUS / name).read_text()), dict), name
    sources = (CORPUS / "SOURCES.md").read_text()
    for name in FILES + [f"refused/{p.name}" for p in (CORPUS / "refused").glob("*.json")]:
        assert name.split("/")[-1] in sources, f"{name} has no recorded source"


@pytest.mark.parametrize("name", FILES)
def test_config_trains_two_steps_on_two_nodes(corpus_runs: dict, name: str) -> None:
    run = corpus_runs[name]
    assert run["applied"] == STEPS, f"{name}: {run['applied']} optimizer steps applied"
    assert all(math.isfinite(v) for v in run["losses"]), run["losses"]
    # every parameter moves, unless the schedule's first steps use lr 0 (DeepSpeed's WarmupLR from 0 does)
    moved = run["params"] if max(run["lrs"]) > 0 else 0
    assert run["changed"] == moved, f"{name}: {run['changed']} of {run['params']} changed at lrs {run['lrs']}"


def test_the_corpus_spans_every_stage_and_accumulation(corpus_runs: dict) -> None:
    assert {r["stage"] for r in corpus_runs.values()} == {0, 1, 2, 3}
    assert max(r["gas"] for r in corpus_runs.values()) > 1


@pytest.mark.parametrize("name, path", [
    ("deepspeed-zero-one-adam-tutorial.json", "optimizer.type"),
    ("llamafactory-ds_z2_autotp_config.json", "tensor_parallel.autotp_size"),
])
def test_refused_configs_name_what_is_missing(name: str, path: str) -> None:
    from zeropp.hf import auto_values
    raw = json.loads((CORPUS / "refused" / name).read_text())
    given = auto_values(_training_args("/tmp"), None, num_training_steps=STEPS)
    with pytest.raises(NotSupportedError) as err:
        load_config(raw, given)
    assert err.value.problems[0].startswith(f"{path}: not supported yet")
