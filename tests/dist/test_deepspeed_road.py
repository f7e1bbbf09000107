"""The DeepSpeed road: transformers' plain ``Trainer`` with ``TrainingArguments(deepspeed=config)`` trains through
zeropp once ``zeropp.install_deepspeed_alias()`` ran before transformers was imported; no trainer class is
swapped. 2 nodes x 2 ranks, stage 3, fp32, the config's batch and clipping values ``"auto"`` (the Trainer fills
them), the Trainer's own AdamW and linear schedule. Against the plain Trainer in this process on the same rows
per step: each step's loss, gradient norm and learning rate; a resume from the step-4 checkpoint continues with
the same losses; ``save_model`` writes a ``model.safetensors`` that ``from_pretrained`` loads in this plain
process to the engine's own weights and logits. TRL's ``SFTTrainer`` with ``peft_config=`` (its default activation
checkpointing on) and ``DPOTrainer`` with a LoRA policy, through ``deepspeed=`` only: the same losses and gradient
norms as TRL's own trainers without DeepSpeed. accelerate's own loop with ``DeepSpeedPlugin`` (``DummyOptim``,
``DummyScheduler``, ``accumulate``, ``clip_grad_norm_``, ``save_state``/``load_state``): the same losses as the
loop without DeepSpeed. A model by name at stage 3 (``from_pretrained`` after ``TrainingArguments(deepspeed=...)``)
loads partitioned, equal to a plain load, gathering one parameter at a time, and trains as the plain Trainer.
TRL's installed ``trl/scripts/sft.py`` and ``dpo.py`` run unchanged under ``torchrun -m zeropp.tools.run`` with
``--deepspeed`` at stage 3 and a local model directory."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from support.world import run_world

STEPS, MICRO, RANKS = 6, 2, 4
IDS = torch.tensor([[5, 9, 14, 3, 27, 40, 2, 11]])  # logits compared after a save
CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
          "topology": {"ranks_per_node": 2}}


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def arguments(out: str, rows: int, deepspeed: dict | None) -> object:
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=out, per_device_train_batch_size=rows, max_steps=STEPS, learning_rate=1e-2,
                             warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1,
                             save_strategy="steps", save_steps=2, use_cpu=True, report_to=[], disable_tqdm=True,
                             seed=0, train_sampling_strategy="sequential", deepspeed=deepspeed)


def history(trainer: object) -> list[tuple[float, float, float]]:
    return [(h["loss"], float(h["grad_norm"]), h["learning_rate"])
            for h in trainer.state.log_history if "loss" in h]  # type: ignore[attr-defined]


def run(rank: int, world: int, root: str) -> dict:
    import zeropp
    zeropp.install_deepspeed_alias()  # before transformers is imported, as a recipe's one changed line
    import transformers

    from zeropp.tools.demo.data import CorpusWindows
    first = transformers.Trainer(model=llama(), args=arguments(os.path.join(root, "run"), MICRO, dict(CONFIG)),
                                 train_dataset=CorpusWindows(32, 256))
    first.train()
    engine = first.model_wrapped
    final = os.path.join(root, "final")
    first.save_model(final)
    state = engine.consolidated_state_dict()
    resumed = transformers.Trainer(model=llama(), args=arguments(os.path.join(root, "run"), MICRO, dict(CONFIG)),
                                   train_dataset=CorpusWindows(32, 256))
    resumed.train(resume_from_checkpoint=os.path.join(root, "run", "checkpoint-4"))
    return {"history": history(first), "resumed": history(resumed), "engine": type(engine).__name__,
            "final": final, "state": state if rank == 0 else None,
            "sft_lora": trl_sft(os.path.join(root, "sft_lora"), MICRO, dict(CONFIG)),
            "dpo_lora": trl_dpo(os.path.join(root, "dpo_lora"), MICRO, dict(CONFIG)),
            "dpo_full": trl_dpo(os.path.join(root, "dpo_full"), MICRO, dict(CONFIG), peft=False),
            "pretrained": by_name(rank, root), "zeropp_trainer": zeropp_trainer_road(root),
            "peft_resume": peft_resume(root)}


def peft_resume(root: str) -> dict:
    """A PEFT model through the plain Trainer: its checkpoints leave the frozen base out
    (``save_checkpoint(exclude_frozen_parameters=True)``, as the Trainer asks on a PEFT model) and resume
    (``load_module_strict=False``) with the same losses."""
    import json as json_

    import transformers

    from test_hf_peft import lora_llama
    from zeropp.tools.demo.data import CorpusWindows
    out = os.path.join(root, "peft")
    first = transformers.Trainer(model=lora_llama(), args=arguments(out, MICRO, dict(CONFIG)),
                                 train_dataset=CorpusWindows(32, 256))
    first.train()
    tag = os.path.join(out, "checkpoint-4", "global_step4")
    with open(os.path.join(tag, "manifest.json")) as f:
        manifest = json_.load(f)
    resumed = transformers.Trainer(model=lora_llama(), args=arguments(out, MICRO, dict(CONFIG)),
                                   train_dataset=CorpusWindows(32, 256))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    try:  # strict (DeepSpeed's default): the frozen parameters are missing
        resumed.model_wrapped.load_checkpoint(os.path.join(out, "checkpoint-4"))
        strict = None
    except Exception as err:  # noqa: BLE001 - the message is checked
        strict = str(err)
    return {"history": history(first), "resumed": history(resumed), "excluded": manifest.get("excluded_frozen", []),
            "saved": [p["name"] for p in manifest["params"]], "strict": strict}


def zeropp_trainer_road(root: str) -> dict:
    """``ZeroppTrainer`` given ``TrainingArguments.deepspeed`` takes its config from there (Note [one engine, two
    roads]); with ``zeropp_config=`` as well it refuses, naming both."""
    from zeropp.hf import ZeroppTrainer, ZeroppTrainerError
    from zeropp.tools.demo.data import CorpusWindows
    args = arguments(os.path.join(root, "zeropp_trainer"), MICRO, dict(CONFIG))
    try:
        ZeroppTrainer(model=llama(), args=args, train_dataset=CorpusWindows(32, 256), zeropp_config=dict(CONFIG))
        twice = None
    except ZeroppTrainerError as err:
        twice = str(err)
    trainer = ZeroppTrainer(model=llama(), args=args, train_dataset=CorpusWindows(32, 256))
    before = trainer.engine
    trainer.train()
    return {"history": history(trainer), "twice": twice, "before": before,
            "engine": type(trainer.engine).__name__, "same": trainer.engine is trainer.model_wrapped}


def by_name(rank: int, root: str) -> dict:
    """A recipe's model by name at stage 3: ``TrainingArguments(deepspeed=...)`` first (it registers
    transformers' ``HfDeepSpeedConfig``), then ``from_pretrained``, which builds under ``deepspeed.zero.Init`` and
    loads rank 0's reading through ``GatheredParameters(modifier_rank=0)``; then the plain Trainer trains it."""
    import torch.distributed as dist
    import transformers

    import deepspeed
    from zeropp.tools.demo.data import CorpusWindows
    from zeropp.zero.construction import PARAMS
    path = os.path.join(root, "pretrained")
    if rank == 0:
        llama().save_pretrained(path)
    dist.barrier()
    args = arguments(os.path.join(root, "by_name"), MICRO, dict(CONFIG))
    gather, peak = PARAMS.gather, [0]

    def tracked(param: torch.nn.Parameter) -> object:  # bytes gathered at once while loading
        out = gather(param)
        peak[0] = max(peak[0], sum(PARAMS.get(p).nbytes for p in PARAMS.gathered()))
        return out
    PARAMS.gather = tracked  # type: ignore[method-assign]
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    finally:
        del PARAMS.gather
    params = list(model.parameters())
    partitioned = all(p.ds_status.name == "NOT_AVAILABLE" for p in params)
    plain = llama().state_dict()
    with deepspeed.zero.GatheredParameters(params):
        diff = max((p - plain[n]).abs().max().item() for n, p in model.named_parameters())
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CorpusWindows(32, 256))
    trainer.train()
    return {"history": history(trainer), "partitioned": partitioned, "diff": diff, "peak_gathered": peak[0],
            "largest_param": max(p.numel() * p.element_size() for p in plain.values())}


def trl_sft(out: str, rows: int, deepspeed: dict) -> dict:
    """TRL's SFTTrainer on its defaults with a LoRA adapter, ZeRO switched on by ``deepspeed=`` only."""
    from trl import SFTConfig, SFTTrainer
    from test_hf_peft import char_tokenizer, lora_config, sft_llama, text_lines
    args = SFTConfig(output_dir=out, per_device_train_batch_size=rows, max_steps=3, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True,
                     max_length=48, train_sampling_strategy="sequential", bf16=False, seed=0, deepspeed=deepspeed)
    assert args.gradient_checkpointing  # TRL's default, kept
    trainer = SFTTrainer(model=sft_llama(), args=args, train_dataset=text_lines(), processing_class=char_tokenizer(),
                         peft_config=lora_config())
    trainer.train()
    adapter = os.path.join(out, "adapter")
    trainer.save_model(adapter)  # collective: the adapter's weights gathered from every rank
    engine = trainer.model_wrapped
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=IDS).logits
    return {"history": [h[:2] for h in history(trainer)], "engine": type(engine).__name__, "adapter": adapter,
            "logits": logits}


def trl_dpo(out: str, rows: int, deepspeed: dict, peft: bool = True) -> dict:
    """TRL's DPOTrainer through ``deepspeed=``: a LoRA policy (the reference is the policy without its adapter),
    or (``peft=False``) the whole policy with a reference model, which TRL hands to ``deepspeed.initialize`` on
    its own (partitioned too, at stage 3)."""
    from trl import DPOConfig, DPOTrainer
    from test_hf_peft import char_tokenizer, lora_config, preferences, sft_llama
    args = DPOConfig(output_dir=out, per_device_train_batch_size=rows, max_steps=3, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True,
                     max_length=48, train_sampling_strategy="sequential", bf16=False, seed=0, deepspeed=deepspeed,
                     gradient_checkpointing=peft)
    kw = {"peft_config": lora_config()} if peft else {"ref_model": sft_llama()}
    trainer = DPOTrainer(model=sft_llama(), args=args, train_dataset=preferences(), processing_class=char_tokenizer(),
                         **kw)
    trainer.train()
    out = {"history": [h[:2] for h in history(trainer)], "engine": type(trainer.model_wrapped).__name__}
    if not peft:
        out["ref_engine"] = type(trainer.ref_model).__name__
    return out


@functools.lru_cache(maxsize=None)
def results(root: str) -> list:
    # spawned ranks (env set): a fresh interpreter in which the alias is installed before transformers loads
    return run_world(run, RANKS, root, ranks_per_node=2, env={"ZEROPP_FRESH_INTERPRETER": "1"})


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list:
    return results(str(tmp_path_factory.mktemp("road")))


@functools.lru_cache(maxsize=None)
def reference(root: str) -> list[tuple[float, float, float]]:
    """The plain Trainer in this process (no DeepSpeed, no zeropp): the 4 ranks' micro-batches in one."""
    import transformers

    from zeropp.tools.demo.data import CorpusWindows
    trainer = transformers.Trainer(model=llama(), args=arguments(root, MICRO * RANKS, None),
                                   train_dataset=CorpusWindows(32, 256))
    trainer.train()
    return history(trainer)


def test_the_plain_trainer_with_deepspeed_config_trains_through_zeropp(world: list,
                                                                        tmp_path_factory: pytest.TempPathFactory):
    assert world[0]["engine"] == "DeepSpeedEngine"  # accelerate built it through deepspeed.initialize
    ref = reference(str(tmp_path_factory.mktemp("road_ref")))
    for rank in world:
        got = rank["history"]
        assert len(got) == len(ref) == STEPS
        for step, (ours, theirs) in enumerate(zip(got, ref)):
            assert ours == pytest.approx(theirs, abs=1e-5), f"step {step + 1}: (loss, grad norm, lr)"


def test_a_peft_runs_checkpoints_leave_the_frozen_base_out_and_resume(world: list):
    for rank in world:
        got = rank["peft_resume"]
        assert got["excluded"] and not any("lora" in n for n in got["excluded"])  # the base weights
        assert got["saved"] and all("lora" in n for n in got["saved"])  # the adapter's
        assert "saved without the frozen parameters" in got["strict"] and "load_module_strict=False" in got["strict"]
        assert len(got["resumed"]) == STEPS
        for ours, first in zip(got["resumed"][4:], got["history"][4:]):
            assert ours == pytest.approx(first, abs=1e-6)


def test_a_model_by_name_loads_partitioned_and_trains_as_the_plain_trainer(world: list,
                                                                          tmp_path_factory: pytest.TempPathFactory):
    ref = reference(str(tmp_path_factory.mktemp("road_ref")))
    for rank in world:
        got = rank["pretrained"]
        assert got["partitioned"] and got["diff"] == 0.0  # the weights of a plain from_pretrained, partitioned
        # transformers gathers one module's own parameters at a time (a Llama's: one parameter)
        assert 0 < got["peak_gathered"] <= got["largest_param"]
        assert len(got["history"]) == STEPS
        for step, (ours, theirs) in enumerate(zip(got["history"], ref)):
            assert ours == pytest.approx(theirs, abs=1e-5), f"step {step + 1}: (loss, grad norm, lr)"


def test_zeropp_trainer_takes_its_config_from_training_arguments_deepspeed(
        world: list, tmp_path_factory: pytest.TempPathFactory):
    ref = reference(str(tmp_path_factory.mktemp("road_ref")))
    for rank in world:
        got = rank["zeropp_trainer"]
        assert "TrainingArguments.deepspeed" in got["twice"] and "zeropp_config" in got["twice"]
        assert got["before"] is None and got["engine"] == "DeepSpeedEngine" and got["same"]
        for step, (ours, theirs) in enumerate(zip(got["history"], ref)):
            assert ours == pytest.approx(theirs, abs=1e-5), f"step {step + 1}: (loss, grad norm, lr)"
        assert len(got["history"]) == STEPS


def test_resuming_from_a_checkpoint_continues_with_the_same_losses(world: list):
    for rank in world:  # the state file brings steps 1-4's log; steps 5-6 are trained again after the load
        assert len(rank["resumed"]) == STEPS
        for ours, first in zip(rank["resumed"][4:], rank["history"][4:]):
            assert ours == pytest.approx(first, abs=1e-6)


def test_save_model_writes_weights_from_pretrained_loads_to_the_engines_logits(world: list):
    from transformers import AutoModelForCausalLM
    state = world[0]["state"]
    loaded = AutoModelForCausalLM.from_pretrained(world[0]["final"])
    assert os.path.exists(os.path.join(world[0]["final"], "model.safetensors"))
    ours = llama()
    ours.load_state_dict(state)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name  # fp32 training: the 16-bit save is the fp32 master
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours(ids).logits)


def _matches(got: list, want: list) -> None:
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-5), f"step {step + 1}: (loss, grad norm)"


def test_trls_sft_trainer_with_lora_through_deepspeed_config_matches_trls_own(
        world: list, tmp_path_factory: pytest.TempPathFactory):
    from test_hf_peft import sft
    want = sft(str(tmp_path_factory.mktemp("road_sft")), MICRO * RANKS, zeropp=False, peft=True)
    for rank in world:
        assert rank["sft_lora"]["engine"] == "DeepSpeedEngine"
        _matches(rank["sft_lora"]["history"], want)
    # the adapter the Trainer saved loads in this plain process onto the same base to the engine's logits
    from peft import PeftModel

    from test_hf_peft import sft_llama
    plain = PeftModel.from_pretrained(sft_llama(), world[0]["sft_lora"]["adapter"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=IDS).logits, world[0]["sft_lora"]["logits"], rtol=1e-5, atol=1e-5)


def test_trls_dpo_trainer_with_a_lora_policy_through_deepspeed_config_matches_trls_own(
        world: list, tmp_path_factory: pytest.TempPathFactory):
    from test_hf_peft import dpo
    want = dpo(str(tmp_path_factory.mktemp("road_dpo")), MICRO * RANKS, zeropp=False, peft=True)["history"]
    for rank in world:
        assert rank["dpo_lora"]["engine"] == "DeepSpeedEngine"
        _matches(rank["dpo_lora"]["history"], want)


def test_trls_dpo_trainer_with_a_whole_policy_and_reference_through_deepspeed_config_matches_trls_own(
        world: list, tmp_path_factory: pytest.TempPathFactory):
    from test_hf_peft import dpo
    want = dpo(str(tmp_path_factory.mktemp("road_dpo_full")), MICRO * RANKS, zeropp=False)["history"]
    for rank in world:
        assert rank["dpo_full"]["engine"] == "DeepSpeedEngine" == rank["dpo_full"]["ref_engine"]
        _matches(rank["dpo_full"]["history"], [h[:2] for h in want])


# ---- accelerate's own loop -----------------------------------------------------------------------------------
GAS = 2
SCHEDULE = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "warmup_type": "linear"}
LOOP_CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
               "scheduler": {"type": "WarmupLR", "params": SCHEDULE},
               "zero_optimization": {"stage": 3}, "topology": {"ranks_per_node": 2}}


def micro_batches(rank: int, world: int) -> list[torch.Tensor]:
    """Rank ``rank``'s micro-batches of token ids: consecutive rows of the shipped corpus, rank-major."""
    from zeropp.tools.demo.data import CorpusWindows
    data = CorpusWindows(32, 256)
    return [torch.stack([data[((i * world + rank) * MICRO + j) % len(data)]["input_ids"] for j in range(MICRO)])
            for i in range(4 * GAS)]


def accelerate_loop(rank: int, world: int, root: str) -> dict:
    import zeropp
    zeropp.install_deepspeed_alias()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(LOOP_CONFIG)),
                              gradient_accumulation_steps=GAS)
    model = llama()
    optimizer = DummyOptim(model.parameters())
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, DummyScheduler(optimizer))
    losses = []
    for ids in micro_batches(rank, world):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    before = model.consolidated_state_dict()
    accelerator.save_state(os.path.join(root, "state"))
    with torch.no_grad():  # spoil the weights: load_state must bring them back
        for p in model.master_optimizer.param_groups[0]["params"]:
            p.zero_()
        model.masters_changed()
    accelerator.load_state(os.path.join(root, "state"))
    after = model.consolidated_state_dict()
    return {"losses": losses, "engine": type(model).__name__,
            "restored": all(torch.equal(before[k], after[k]) for k in before)}


def test_accelerates_own_loop_with_the_deepspeed_plugin_matches_the_loop_without(
        tmp_path_factory: pytest.TempPathFactory):
    from zeropp.optim import WarmupLR
    got = run_world(accelerate_loop, RANKS, str(tmp_path_factory.mktemp("road_loop")), ranks_per_node=2,
                    env={"ZEROPP_FRESH_INTERPRETER": "1"})
    assert all(r["engine"] == "DeepSpeedEngine" and r["restored"] for r in got)
    model = llama()  # the same loop without DeepSpeed: the ranks' micro-batches in one, the loss over GAS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = WarmupLR(optimizer, **SCHEDULE)
    per_rank = [micro_batches(r, RANKS) for r in range(RANKS)]
    for i in range(4 * GAS):
        ids = torch.cat([rows[i] for rows in per_rank])
        loss = model(input_ids=ids, labels=ids).loss
        (loss / GAS).backward()
        mean = sum(r["losses"][i] for r in got) / RANKS  # every row has the same number of tokens
        assert mean == pytest.approx(float(loss), abs=1e-5), f"micro-step {i + 1}"
        if (i + 1) % GAS == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


# ---- an unchanged script under the launcher ------------------------------------------------------------------
@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_trls_scripts_run_unchanged_under_the_launcher(tmp_path: "os.PathLike[str]", script: str):
    """``torchrun ... -m zeropp.tools.run trl/scripts/{sft,dpo}.py --deepspeed ds.json`` on 2 ranks, a local model
    directory and local rows, stage 3: TRL loads the model (and DPO's reference) through transformers' ZeRO-3
    ``from_pretrained`` and computes its loss with its fused LM-head kernel (which reads ``weight.ds_status`` in
    its backward)."""
    import trl

    from test_hf_peft import char_tokenizer, preferences, sft_llama, text_lines
    model_dir, data_dir, out = (os.path.join(tmp_path, name) for name in ("model", "data", "out"))
    sft_llama().save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    os.makedirs(data_dir)
    rows = text_lines() if script == "sft" else preferences()
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    config = os.path.join(tmp_path, "ds.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}, f)
    path = os.path.join(os.path.dirname(trl.__file__), "scripts", f"{script}.py")
    port = 29000 + os.getpid() % 1000 + (0 if script == "sft" else 1)
    extra = ["--max_length", "48"] if script == "sft" else ["--max_length", "48", "--no_remove_unused_columns"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         "-m", "zeropp.tools.run", path, "--model_name_or_path", model_dir, "--dataset_name", data_dir,
         "--output_dir", out, "--max_steps", "2", "--per_device_train_batch_size", "2", "--deepspeed", config,
         "--use_cpu", "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no",
         "--disable_tqdm", "true", *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "zeropp run: " in log and "with zeropp's DeepSpeed API as `deepspeed`" in log
    losses = [float(line.split("'loss': '")[1].split("'")[0]) for line in log.splitlines() if "'loss': '" in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), log[-2000:]
    assert os.path.exists(os.path.join(out, "model.safetensors"))


LAUNCHED = '''
import json, sys
import torch
from accelerate import Accelerator
acc = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
model, opt, loader = acc.prepare(model, opt, loader)
losses = []
for xb, yb in loader:
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print("RESULT " + json.dumps({"engine": type(model).__name__, "losses": losses,
                              "deepspeed": getattr(sys.modules.get("deepspeed"), "__name__", None)}), flush=True)
'''


def _results(out: str) -> list[dict]:
    """The ``RESULT {...}`` objects printed, also when two ranks' lines ran together."""
    decoder, found = json.JSONDecoder(), []
    for part in out.split("RESULT ")[1:]:
        found.append(decoder.raw_decode(part)[0])
    return found


ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: false
machine_rank: 0
num_machines: 1
num_processes: 2
main_process_port: {port}
"""


_ALONE: dict[str, dict] = {}


def _alone(script: str) -> dict:
    """What the accelerate script prints run in one process without DeepSpeed (the same for every launch)."""
    if LAUNCHED not in _ALONE:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        alone = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
        (_ALONE[LAUNCHED],) = _results(alone.stdout)
    return _ALONE[LAUNCHED]


@pytest.mark.parametrize("how", ["flags", "config_file"])
def test_accelerate_launch_with_deepspeed_runs_through_zeropp(tmp_path: "os.PathLike[str]", how: str):
    """``zeropp run accelerate launch --use_deepspeed ...``: accelerate's launcher (which imports DeepSpeed's runner
    in the launching process) and both ranks it spawns run with zeropp's DeepSpeed API, and an accelerate script
    trains on zeropp's engine at stage 3. On a machine without a GPU accelerate counts one process under its
    DeepSpeed launcher (it finds no device backend), so each rank iterates every row: the same losses as the
    script in one process without DeepSpeed."""
    script, config = os.path.join(tmp_path, "train.py"), os.path.join(tmp_path, "ds.json")
    with open(script, "w") as f:
        f.write(LAUNCHED)
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 3}}, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    port = 29000 + os.getpid() % 1000 + (2 if how == "flags" else 3)
    if how == "flags":
        launch = ["--use_deepspeed", "--deepspeed_config_file", config, "--num_processes", "2", "--main_process_port",
                  str(port)]
    else:  # an accelerate config file that names the DeepSpeed config, as `accelerate config` writes one
        accelerate_config = os.path.join(tmp_path, "accelerate.yaml")
        with open(accelerate_config, "w") as f:
            f.write(ACCELERATE_CONFIG.format(ds=config, port=port))
        launch = ["--config_file", accelerate_config]
    launched = subprocess.run([sys.executable, "-m", "zeropp.tools.cli", "run", "accelerate", "launch", *launch, script],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    log = launched.stdout + launched.stderr
    assert launched.returncode == 0, log[-3000:]
    results, want = _results(launched.stdout), _alone(script)
    assert len(results) == 2  # both ranks
    for got in results:
        assert got["engine"] == "DeepSpeedEngine" and got["deepspeed"] == "zeropp.deepspeed"
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-6) and len(got["losses"]) == 16
    assert want["engine"] == "Sequential" and want["deepspeed"] is None


def test_trls_command_runs_under_zeropp_run(tmp_path: "os.PathLike[str]"):
    """``zeropp run trl sft ... --deepspeed ds.json``: TRL's own command (a console script on PATH) at stage 3."""
    from test_hf_peft import char_tokenizer, sft_llama, text_lines
    model_dir, data_dir, out = (os.path.join(tmp_path, name) for name in ("model", "data", "out"))
    sft_llama().save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    os.makedirs(data_dir)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in text_lines())
    config = os.path.join(tmp_path, "ds.json")
    with open(config, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}, f)
    proc = subprocess.run(
        [sys.executable, "-m", "zeropp.tools.cli", "run", "trl", "sft", "--model_name_or_path", model_dir,
         "--dataset_name", data_dir, "--output_dir", out, "--max_steps", "2", "--per_device_train_batch_size", "2",
         "--deepspeed", config, "--use_cpu", "--report_to", "none", "--max_length", "48", "--logging_steps", "1",
         "--save_strategy", "no", "--disable_tqdm", "true"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "zeropp run: trl with zeropp's DeepSpeed API as `deepspeed`" in log
    losses = [float(line.split("'loss': '")[1].split("'")[0]) for line in log.splitlines() if "'loss': '" in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), log[-2000:]
