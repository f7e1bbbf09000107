"""transformers' Trainer trains through zeropp (``zeropp.hf.ZeroppTrainer``) on 2 nodes x 2 ranks: a tiny GPT-2
from a config on the shipped corpus with ZeRO-3 + qwZ + hpZ + qgZ in bf16, every "auto" filled from the
TrainingArguments. One world runs training, a mid-run checkpoint, save_model, a resume and the early errors
(tests/support/hf_trainer_case.py); the saved directory is then loaded in this plain process. A second module
fixture runs examples/hf_trainer.py under torchrun."""
from __future__ import annotations

import functools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from support.hf_trainer_case import (  # noqa: E402
    BLOCK, PLATEAU, SAVE_AT, STEPS, corpus_windows, reference_parity, reference_parity_again, run, tiny_gpt2,
)
from support.world import run_world  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(run, 4, str(tmp_path_factory.mktemp("hf_trainer")), ranks_per_node=2)


@functools.lru_cache(maxsize=None)
def _batch() -> torch.Tensor:
    from zeropp.tools.demo.data import corpus_tokens
    tokens = corpus_tokens()
    return torch.stack([tokens[o: o + BLOCK] for o in (1000, 50_000, 150_000)])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(_batch()).logits


def test_the_loss_decreases_on_every_rank_alike(world: list[dict]) -> None:
    losses = world[0]["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 0.3, losses  # ~5.35 -> ~4.7 in six steps (two of warm-up at lr 0)
    assert all(r["losses"] == losses for r in world)  # the Trainer logs the loss averaged over ranks


def test_the_engine_ran_stage3_with_zeropp_and_the_trainers_schedule(world: list[dict]) -> None:
    r = world[0]
    assert r["stage"] == 3 and r["lr_scheduler"] == "WarmupDecayLR"
    comm = r["comm"]
    assert comm["backward_gather"]["inter_node_bytes"] == 0  # hpZ: backward gathers stay inside a node
    assert comm["forward_gather"]["inter_node_bytes"] > 0 and comm["grad_reduce"]["inter_node_bytes"] > 0
    steps = [h for h in r["log"] if "loss" in h]
    # what the Trainer logs: the engine's global norm (before clipping at max_grad_norm=1) and the lr each step
    # used: DeepSpeed's linear WarmupDecayLR over warmup_steps=2 of STEPS, from the "auto" values
    assert all(h["grad_norm"] > 1.0 and math.isfinite(h["grad_norm"]) for h in steps)
    lr = [h["learning_rate"] for h in steps]
    assert lr[:4] == pytest.approx([0.0, 0.0, 1.5e-3, 3e-3]) and lr[4] < lr[3]


def test_fp32_training_matches_the_plain_trainer(world: list[dict], tmp_path: Path) -> None:
    """Same rows per step, the Trainer's own AdamW (weight-decay groups), linear schedule and clipping: the
    loss, the pre-clipping gradient norm and the learning rate of each step agree with a single-process
    ``transformers.Trainer`` (fp32 reduction order only: 1e-5 relative, as tests/dist/test_transformers.py).
    Double scaling for accumulation would double the norm; a missed or double clip or schedule step would
    move the losses and rates."""
    # a loss normalised by the accumulated token count (GPT-2 takes num_items_in_batch), and a per-micro-batch
    # mean (the Trainer divides it by the accumulation steps): the two ways the Trainer scales for accumulation
    for case, batch_mean in (("parity", False), ("parity_batch_mean", True)):
        got, want = world[0][case], reference_parity(str(tmp_path), batch_mean)
        assert len(got) == len(want) == 4 and want[0][1] > 1.0  # above max_grad_norm: clipping is exercised
        for step, (g, w) in enumerate(zip(got, want)):
            assert g[0] == pytest.approx(w[0], rel=1e-5), f"{case} step {step} loss"
            assert g[1] == pytest.approx(w[1], rel=1e-5), f"{case} step {step} grad_norm"
            assert g[2] == pytest.approx(w[2], rel=1e-12), f"{case} step {step} learning_rate"


def test_a_second_train_continues_as_the_plain_trainers(world: list[dict], tmp_path: Path) -> None:
    """``train()`` again on the same trainer, as the Trainer runs it: the trained weights and Adam's state carry
    on, the linear schedule starts over (warm-up again), the steps count from 1 again."""
    first, again = reference_parity_again(str(tmp_path))
    got, engine_steps = world[0]["parity_again"]
    assert engine_steps == len(got) == len(again) == 4 and again[0][0] < first[0][0]  # trained weights
    assert [h[2] for h in again] == [h[2] for h in first]  # the schedule started over
    for step, (g, w) in enumerate(zip(got, again)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"
        assert g[2] == pytest.approx(w[2], rel=1e-12), f"step {step} learning_rate"


def _same_history(got: list, want: list) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"
        assert g[2] == pytest.approx(w[2], rel=1e-12), f"step {step} learning_rate"


@pytest.mark.parametrize("built", ["zero_init", "pretrained"])
def test_a_model_partitioned_at_construction_trains_as_the_plain_trainers(world: list[dict], tmp_path: Path,
                                                                          built: str) -> None:
    """The model built under ``zero.Init``, or read by ``zeropp.hf.from_pretrained``: the Trainer's move to its
    device leaves the partitioned parameters where they are (``.to`` on one was refused), and the run is the
    plain Trainer's step by step."""
    _same_history(world[0]["parity_built"][built], reference_parity(str(tmp_path), False))


def test_model_init_builds_a_new_model_and_engine_for_each_train(world: list[dict], tmp_path: Path) -> None:
    """``model_init`` (what hyperparameter search uses): each ``train()`` starts from a new model, so both runs
    equal the plain Trainer's first run, and the second ran on a new engine over the new model."""
    first, again, new_engine = world[0]["model_init"]
    want = reference_parity(str(tmp_path), False)
    _same_history(first, want)
    _same_history(again, want)
    assert new_engine


def test_reduce_lr_on_plateau_steps_with_the_eval_metric_and_resumes(world: list[dict], tmp_path: Path) -> None:
    """``lr_scheduler_type="reduce_lr_on_plateau"``: the Trainer steps it with each evaluation's loss, over the
    engine's optimizer, at stage 0 with Trainer checkpoints: the same losses, norms and halved rates as the
    plain Trainer; a resume from step 2 restores the schedule's state and continues as the first run did."""
    first, resumed = world[0]["plateau"]
    _same_history(first, reference_parity(str(tmp_path), False, **PLATEAU))
    rates = [h[2] for h in first]
    assert rates[0] == rates[1] == pytest.approx(2 * rates[2]) == pytest.approx(4 * rates[3])  # halved from eval 2
    assert len(resumed) == 4 and resumed[2:] == first[2:]  # steps 1-2 are the checkpoint's own log


def test_torch_compile_trains_through_the_engine_as_eager(world: list[dict]) -> None:
    """TrainingArguments(torch_compile=True): the engine compiles per block (aot_eager: eager's kernels, so the
    same values as the eager parity run, step by step)."""
    history, compiled = world[0]["parity_compiled"]
    assert compiled and history == world[0]["parity"]


def test_an_epoch_ending_inside_a_window_steps_as_the_plain_trainer(world: list[dict], tmp_path: Path) -> None:
    """10 micro-batches per rank in windows of 4: the last step takes 2, scaled as the Trainer scales them;
    each step's loss, gradient norm and learning rate agree with one process's batches of 32, 32 and 16 rows."""
    got, want = world[0]["parity_epoch"], reference_parity(str(tmp_path), False, epoch=True)
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"
        assert g[2] == pytest.approx(w[2], rel=1e-12), f"step {step} learning_rate"


def test_save_model_loads_in_a_plain_process_as_the_fp32_masters(world: list[dict]) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    r = world[0]
    final = Path(r["final"])
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys  # tied: stored once
        assert f.get_tensor("transformer.wte.weight").dtype == torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(str(final))
    assert loaded.dtype == torch.float32
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again on load
    fresh = GPT2LMHeadModel(GPT2Config.from_pretrained(str(final)))
    fresh.load_state_dict(r["consolidated"])
    # the file holds exactly engine.consolidated_state_dict() (fp32 masters): the same logits, bit for bit
    assert torch.equal(_logits(loaded), _logits(fresh))
    untrained = _logits(tiny_gpt2(seed=0))  # and training changed them
    assert (_logits(loaded) - untrained).abs().max() > 1e-2


def _plain_loss(model: torch.nn.Module) -> float:
    rows = corpus_windows(32).rows
    model.eval()
    with torch.no_grad():
        return model(input_ids=rows, labels=rows).loss.item()


def test_evaluate_runs_through_the_engine_and_before_it(world: list[dict]) -> None:
    from transformers import AutoModelForCausalLM

    r = world[0]
    # after training: the engine's bf16 forward (qwZ's int8 weights) against the saved fp32 masters in a plain
    # process; bf16 keeps 8 significant bits, and 4 * 2**-8 bounds the rounding of a short run's loss
    # (tests/dist/test_transformers.py), far below the ~0.6 the loss moved in training
    saved = _plain_loss(AutoModelForCausalLM.from_pretrained(r["final"]))
    assert r["eval_loss"] == pytest.approx(saved, rel=4 * 2**-8)
    # before train() nothing is partitioned: the plain fp32 model, whole on every rank
    assert r["eval_loss_before_train"] == pytest.approx(_plain_loss(tiny_gpt2(seed=1)), rel=1e-6)


def test_evaluation_during_training_leaves_the_training_steps_as_they_were(world: list[dict]) -> None:
    for r in world:
        assert r["with_eval_losses"] == r["losses"]  # bit for bit: evaluating changed no weight, state or rng
        evals = r["with_eval_evals"]
        assert [step for step, _ in evals] == [2, 4, 6]
        assert evals == world[0]["with_eval_evals"]  # every rank reports the same (global) eval loss
        assert evals[-1][1] < evals[0][1]  # the model it evaluated was the one training


def test_load_best_model_at_end_restores_the_best_checkpoints_weights(world: list[dict]) -> None:
    for r in world:
        path, metric, after = r["best"]
        evals = dict(r["with_eval_evals"])
        assert path.endswith("checkpoint-2") and metric == evals[2] == max(evals.values())
        assert after == metric  # evaluated again on the loaded weights: the step-2 model, not the last one
        assert evals[6] != metric


def test_a_trainer_checkpoint_resumes_the_run_exactly(world: list[dict]) -> None:
    r = world[0]
    ckpt = Path(r["checkpoint"])
    assert (ckpt / "latest").read_text().strip() == f"global_step{SAVE_AT}"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "trainer_state.json").is_file()
    assert not (ckpt / "optimizer.pt").exists()  # the optimizer state is the engine's sharded checkpoint
    resumed = r["resumed_losses"]
    # other initial weights, the same data order: steps after the checkpoint repeat the first run's
    assert {s: resumed[s] for s in range(SAVE_AT + 1, STEPS + 1)} == \
        {s: r["losses"][s] for s in range(SAVE_AT + 1, STEPS + 1)}


def test_push_to_hub_uploads_the_directory_save_model_writes(world: list[dict]) -> None:
    """Through a local stand-in for the Hub's API: what is pushed loads with from_pretrained to the engine's
    fp32 weights."""
    from transformers import AutoModelForCausalLM
    repo, state = world[0]["pushed"]
    assert {"config.json", "model.safetensors"} <= set(os.listdir(repo))
    model = AutoModelForCausalLM.from_pretrained(repo)
    got = model.state_dict()
    for name, value in state.items():
        assert torch.equal(got[name], value), name


def test_settings_that_contradict_the_trainer_fail_before_any_collective(world: list[dict]) -> None:
    errors = world[0]["errors"]
    assert errors["precision"].startswith("TrainerConfigMismatch") \
        and "bf16.enabled: True in the config, but TrainingArguments bf16 gives False" in errors["precision"]
    assert "gradient_accumulation_steps: 4 in the config" in errors["gas"], errors["gas"]
    assert "no zeropp engine checkpoint" in errors["resume_without_engine_state"]
    assert all(r["errors"] == errors for r in world[1:])  # every rank refuses alike: nobody waits in a collective


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_example")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    # a free port of our own: with `--master-port 0` the workers see MASTER_PORT=0 and the process-group start
    # (accelerate's, and zeropp's under torchrun's agent store) can wait forever
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
           str(_free_port()), str(EXAMPLE), "--out", str(tmp / "run"), "--steps", "4", "--micro-batch", "2",
           "--block-size", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {"dir": tmp / "run", "stdout": proc.stdout}


def test_the_example_trains_and_saves_under_torchrun(example_run: dict) -> None:
    from transformers import AutoModelForCausalLM

    out = json.loads((example_run["dir"] / "losses.json").read_text())
    assert len(out["losses"]) == 4 and all(3.0 < v < 7.0 for v in out["losses"]), out["losses"]
    assert "ZeRO-3 + qwZ + hpZ + qgZ on 2 nodes x 2 ranks" in example_run["stdout"]
    model = AutoModelForCausalLM.from_pretrained(str(example_run["dir"] / "model"))
    assert torch.isfinite(_logits(model)).all()
