"""Worker functions for tests/dist/test_hf_trainer.py: ``ZeroppTrainer`` on every rank of a 2 nodes x 2 ranks
world, a tiny GPT-2 built from a config (nothing downloaded) on the shipped Shakespeare corpus, with ZeRO-3 and
all of ZeRO++ in bf16.

``run`` trains STEPS optimizer steps (a checkpoint at SAVE_AT), evaluates, saves the model, resumes a second
trainer (evaluated before it trains) from the checkpoint to STEPS again, trains the first run again with
evaluation every 2 steps, runs an fp32 parity case against the
plain Trainer (``reference_parity``, run by the test in its own process) and collects the early errors; it
returns what the tests compare.
"""
from __future__ import annotations

import concurrent.futures
import copy
import os
import shutil
import types
from typing import Any, Callable, Optional

import torch

from support.train import error_of
from zeropp.tools.demo.data import CorpusWindows

STEPS, SAVE_AT, MICRO, GAS, BLOCK = 6, 3, 2, 2, 32
LR = 3e-3
# Hugging Face's own style: the Trainer fills every "auto" (batch, precision, optimizer, schedule, buckets)
CONFIG: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "zero_quantized_weights": True,
                          "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
    "topology": {"ranks_per_node": 2},
}


def corpus_windows(count: int = 256) -> CorpusWindows:
    return CorpusWindows(BLOCK, count)


def tiny_gpt2(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)  # lm_head tied to the token embedding
    # transformers 5.23 infers no loss type from the name "GPT2LMHeadModel", and the Trainer then counts every
    # label of a row as a prediction (32, not 31): its losses come out 31/32 of the true token mean
    model.loss_type = "ForCausalLM"
    return model


def training_args(out: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments
    kw = dict(output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
              max_steps=STEPS, learning_rate=LR, warmup_steps=2, weight_decay=0.01, logging_steps=1,
              save_strategy="steps", save_steps=SAVE_AT, bf16=True, use_cpu=True, report_to=[], seed=0,
              disable_tqdm=True, dataloader_drop_last=True, per_device_eval_batch_size=4)
    kw.update(overrides)
    return TrainingArguments(**kw)


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def run(rank: int, world: int, root: str) -> dict:
    from zeropp.hf import ZeroppTrainer

    out = os.path.join(root, "out")
    data = corpus_windows()
    trainer = ZeroppTrainer(model=tiny_gpt2(seed=0), args=training_args(out), train_dataset=data,
                            zeropp_config=copy.deepcopy(CONFIG))
    trainer.train()
    eval_rows = corpus_windows(32)  # 8 batches of 4: two per rank (dataloader_drop_last applies to eval too)
    evaluated = trainer.evaluate(eval_rows)["eval_loss"]  # forward through the engine (stage-3 gathers)
    final = os.path.join(root, "final")
    trainer.save_model(final)  # collective
    consolidated = trainer.engine.consolidated_state_dict()  # collective too
    result: dict[str, Any] = {
        "losses": _losses(trainer),
        "log": trainer.state.log_history,
        "consolidated": consolidated if rank == 0 else None,
        "final": final,
        "checkpoint": os.path.join(out, f"checkpoint-{SAVE_AT}"),
        "comm": trainer.engine.comm_report(),
        "stage": trainer.engine.zero_optimization_stage(),
        "lr_scheduler": type(trainer.engine.lr_scheduler).__name__,
        "eval_loss": evaluated,
    }
    # a second trainer, other initial weights, resumes from the mid-run checkpoint and trains to STEPS
    resumed = ZeroppTrainer(model=tiny_gpt2(seed=1), args=training_args(os.path.join(root, "out2")),
                            train_dataset=data, zeropp_config=copy.deepcopy(CONFIG))
    result["eval_loss_before_train"] = resumed.evaluate(eval_rows)["eval_loss"]  # no engine yet: the plain model
    resumed.train(resume_from_checkpoint=result["checkpoint"])
    result["resumed_losses"] = _losses(resumed)
    # evaluation during training (eval_strategy) through the engine: the training steps must not see it
    # with load_best_model_at_end, "best" being the highest eval loss: the first checkpoint's weights come back
    evaluating = ZeroppTrainer(model=tiny_gpt2(seed=0), args=training_args(
        os.path.join(root, "out3"), save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True),
        train_dataset=data, eval_dataset=eval_rows, zeropp_config=copy.deepcopy(CONFIG))
    evaluating.train()
    result["with_eval_losses"] = _losses(evaluating)
    result["with_eval_evals"] = [(h["step"], h["eval_loss"]) for h in evaluating.state.log_history
                                 if "eval_loss" in h]
    result["best"] = (evaluating.state.best_model_checkpoint, evaluating.state.best_metric,
                      evaluating.evaluate(eval_rows)["eval_loss"])
    parity = parity_trainer(os.path.join(root, "parity"), data, zeropp=True)
    result["parity"] = _history(parity)
    parity.train()  # a second run on the trained weights and the optimizer's state, with a new schedule
    result["parity_again"] = (_history(parity), parity.engine.global_steps)
    result["parity_batch_mean"] = _history(parity_trainer(os.path.join(root, "parity2"), data, zeropp=True,
                                                          batch_mean_loss=True))
    compiled = parity_trainer(os.path.join(root, "parity4"), data, zeropp=True, torch_compile=True,
                              torch_compile_backend="aot_eager")
    result["parity_compiled"] = (_history(compiled), compiled.engine.is_compiled)
    result["parity_epoch"] = _history(parity_trainer(os.path.join(root, "parity3"), data, zeropp=True, epoch=True))
    result["parity_built"] = built_runs(root, data)
    result["model_init"] = model_init_runs(root, data)
    result["plateau"] = plateau_runs(root, data)
    result["errors"] = errors(root, data)
    result["pushed"] = pushed(root, data)
    return result


class LocalHub:
    """The Hugging Face Hub API as the Trainer calls it (``create_repo``, ``upload_folder``), writing into a
    local directory: the tests have no network."""

    def __init__(self, root: str) -> None:
        self.root = root

    def create_repo(self, repo_id: str, **_: Any) -> Any:
        return types.SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id: str, folder_path: str, ignore_patterns: Any = None, run_as_future: bool = False,
                      **_: Any) -> Any:
        shutil.copytree(folder_path, os.path.join(self.root, repo_id), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*(ignore_patterns or [])))
        if not run_as_future:
            return None
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done


def pushed(root: str, data: Any) -> tuple[str, Any]:
    """``push_to_hub=True`` and ``trainer.push_to_hub()`` on every rank: (the pushed repo's directory, the
    engine's consolidated weights on rank 0)."""
    import transformers.trainer
    from zeropp.hf import ZeroppTrainer

    hub = LocalHub(os.path.join(root, "hub"))
    transformers.trainer.hf_api = lambda: hub
    args = training_args(os.path.join(root, "push"), push_to_hub=True, hub_model_id="local/zeropp-push",
                         save_strategy="no", max_steps=2)
    trainer = ZeroppTrainer(model=tiny_gpt2(seed=0), args=args, train_dataset=data, zeropp_config=copy.deepcopy(CONFIG))
    trainer.train()
    trainer.push_to_hub()  # saves on every rank (collective), uploads from rank 0
    state = trainer.engine.consolidated_state_dict()
    return os.path.join(hub.root, "local/zeropp-push"), (state if trainer.is_world_process_zero() else None)


# fp32 parity with a plain single-process Trainer: ZeRO-3 + hpZ (exact), the Trainer's own optimizer (AdamW with
# its weight-decay groups) and linear schedule, clipping at 1.0, accumulation 2 x 4 ranks x 2 = 16 rows per step
# against 16 rows in one process. Sequential sampling gives both the same rows per optimizer step.
PARITY_STEPS, PARITY_ROWS = 4, MICRO * GAS * 4
PARITY_CONFIG = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}, "topology": {"ranks_per_node": 2}}


# An epoch that ends inside a window: 80 rows are 10 micro-batches of 2 per rank, windows of 4: steps of 4, 4
# and 2 micro-batches (32, 32 and 16 rows), against one process's batches of 32 rows (the last one 16).
EPOCH_ROWS, EPOCH_GAS = 80, 4


# ReduceLROnPlateau stepped by the Trainer with the eval loss after every step: mode "max" with no patience
# halves the rate at every evaluation whose loss is not a new maximum, i.e. from the second on
PLATEAU = dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps", eval_steps=1,
               metric_for_best_model="eval_loss", lr_scheduler_kwargs={"mode": "max", "patience": 0, "factor": 0.5})


def parity_trainer(out: str, data: Any, zeropp: bool, batch_mean_loss: bool = False, epoch: bool = False,
                   model_init: bool = False, zeropp_config: Any = None, train: bool = True,
                   build: Optional[Callable[[], torch.nn.Module]] = None, **extra: Any) -> Any:
    """``batch_mean_loss``: the model is not handed the accumulated token count, so each micro-batch's loss is
    its own mean and the Trainer's rule divides it by the accumulation steps (the engine does, here).
    ``epoch``: one epoch of ``EPOCH_ROWS`` rows whose last window is shorter. ``model_init``: the model comes
    from ``model_init`` (a new one at each ``train()``). An ``eval_strategy`` in ``extra`` evaluates on 16
    rows. ``build`` makes the model another way (zero.Init, from_pretrained); it must give seed 2's weights."""
    import transformers
    from zeropp.hf import ZeroppTrainer

    gas = EPOCH_GAS if epoch else GAS
    batch = dict(per_device_train_batch_size=MICRO, gradient_accumulation_steps=gas) if zeropp else dict(
        per_device_train_batch_size=MICRO * gas * 4, gradient_accumulation_steps=1)
    length = dict(max_steps=-1, num_train_epochs=1, dataloader_drop_last=False) if epoch else dict(
        max_steps=PARITY_STEPS)
    if epoch:
        data = torch.utils.data.Subset(data, range(EPOCH_ROWS))
    kw: dict[str, Any] = dict(bf16=False, warmup_steps=1, weight_decay=0.1, lr_scheduler_type="linear",
                              save_strategy="no", train_sampling_strategy="sequential")
    kw.update(length, **batch, **extra)
    args = training_args(out, **kw)
    make = build or (lambda: tiny_gpt2(seed=2))
    model = dict(model_init=make) if model_init else dict(model=make())
    given = dict(train_dataset=data, eval_dataset=corpus_windows(16) if "eval_strategy" in extra else None)
    if zeropp:
        config = copy.deepcopy(zeropp_config or PARITY_CONFIG)
        trainer = ZeroppTrainer(args=args, **model, **given, zeropp_config=config)
    else:
        trainer = transformers.Trainer(args=args, **model, **given)
    trainer.model_accepts_loss_kwargs = not batch_mean_loss
    if train:
        trainer.train()
    return trainer


STAGE0_CONFIG = {"zero_optimization": {"stage": 0}}


def built_runs(root: str, data: Any) -> dict[str, list]:
    """The parity run with the model partitioned at construction, as big models are built: under
    ``zero.Init``, and read by ``zeropp.hf.from_pretrained`` from a directory rank 0 saved (seed 2's weights)."""
    import torch.distributed as dist

    import zeropp
    from zeropp.hf import from_pretrained

    def under_init() -> torch.nn.Module:
        with zeropp.zero.Init():
            return tiny_gpt2(seed=2)

    saved = os.path.join(root, "seed2")
    if dist.get_rank() == 0:
        tiny_gpt2(seed=2).save_pretrained(saved)
    dist.barrier()

    def pretrained() -> torch.nn.Module:
        model = from_pretrained(saved)
        model.loss_type = "ForCausalLM"  # as tiny_gpt2 sets it (the config does not keep it)
        return model.train()

    return {name: _history(parity_trainer(os.path.join(root, f"built_{name}"), data, zeropp=True, build=make))
            for name, make in (("zero_init", under_init), ("pretrained", pretrained))}


def model_init_runs(root: str, data: Any) -> tuple[list, list, bool]:
    """``model_init``: two ``train()`` calls, each on a new model and a new engine (histories, engine replaced)."""
    trainer = parity_trainer(os.path.join(root, "init"), data, zeropp=True, model_init=True)
    first, engine = _history(trainer), trainer.engine
    trainer.train()
    return first, _history(trainer), trainer.engine is not engine and trainer.engine.module is trainer.model


def plateau_runs(root: str, data: Any) -> tuple[list, list]:
    """ReduceLROnPlateau at stage 0 with Trainer checkpoints every 2 steps; a second trainer resumes from
    the one at step 2. (histories of both)"""
    out = os.path.join(root, "plateau")
    first = parity_trainer(out, data, zeropp=True, zeropp_config=STAGE0_CONFIG, save_strategy="steps",
                           save_steps=2, **PLATEAU)
    resumed = parity_trainer(os.path.join(root, "plateau_resumed"), data, zeropp=True, zeropp_config=STAGE0_CONFIG,
                             train=False, **PLATEAU)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    return _history(first), _history(resumed)


def _history(trainer: Any) -> list[tuple[float, float, float]]:
    """(loss, grad_norm, learning_rate) of each logged optimizer step."""
    return [(h["loss"], float(h["grad_norm"]), h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def reference_parity(root: str, batch_mean_loss: bool, epoch: bool = False, **extra: Any
                     ) -> list[tuple[float, float, float]]:
    """The plain Trainer's run in this (non-distributed) process."""
    return _history(parity_trainer(os.path.join(root, f"reference{int(batch_mean_loss)}{int(epoch)}{len(extra)}"),
                                   corpus_windows(), zeropp=False, batch_mean_loss=batch_mean_loss, epoch=epoch,
                                   **extra))


def reference_parity_again(root: str) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """The plain Trainer's first and second ``train()`` on the same trainer, in this process."""
    trainer = parity_trainer(os.path.join(root, "reference_again"), corpus_windows(), zeropp=False)
    first = _history(trainer)
    trainer.train()
    return first, _history(trainer)


def errors(root: str, data: Any) -> dict[str, str]:
    """Errors raised before any collective (the same on every rank, so none can hang the others)."""
    from zeropp.hf import ZeroppTrainer

    def start(cfg: dict, resume: Any = None, **overrides: Any) -> None:
        args = training_args(os.path.join(root, "err"), save_strategy="no", **overrides)
        trainer = ZeroppTrainer(model=tiny_gpt2(seed=0), args=args, train_dataset=data, zeropp_config=cfg)
        trainer.train(resume_from_checkpoint=resume)

    return {
        # the Trainer says fp16, the config bf16
        "precision": error_of(lambda: start(copy.deepcopy(CONFIG) | {"bf16": {"enabled": True}}, bf16=False,
                                          fp16=True)),
        "gas": error_of(lambda: start(copy.deepcopy(CONFIG) | {"gradient_accumulation_steps": 4})),
        # a model directory is not a Trainer checkpoint: no engine state to resume from
        "resume_without_engine_state": error_of(lambda: start(copy.deepcopy(CONFIG),
                                                            resume=os.path.join(root, "final"))),
    }
