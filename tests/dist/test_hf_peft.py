"""A PEFT LoRA fine-tune through transformers' Trainer (``ZeroppTrainer``) on 2 nodes x 2 ranks: a tiny Llama
built from a config, LoRA on the attention's q and v projections. Plain stage 3 in fp32 matches the plain
Trainer (no zeropp) step by step; ZeRO++ with the frozen base kept int8 (``zero_quantized_nontrainable_weights``)
stays within 2% of it over 10 steps; in both, ``save_model`` writes the adapter, which loads in this plain
process with ``PeftModel.from_pretrained`` to the logits of the engine's own ``consolidated_state_dict()``.
TRL's ``SFTTrainer`` and ``DPOTrainer`` with ``ZeroppTrainer`` mixed in (the documented one-line change) train a
tiny Llama on text lines and preference pairs with a character tokenizer built here, as TRL's own trainers do
in one process; DPO's reference model is partitioned too."""
from __future__ import annotations

import copy
import functools
import math
import os

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("trl")

from support.world import run_world  # noqa: E402

STEPS, MICRO, RANKS = 10, 2, 4
PLUS = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                              "zero_quantized_gradients": True, "zero_quantized_nontrainable_weights": True},
        "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2}}
PLAIN = {"zero_optimization": {"stage": 3}, "topology": {"ranks_per_node": 2}}


def base_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(base_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    lora_dropout=0.0))
    for name, p in model.named_parameters():  # LoRA's B starts at zero: start it off zero so that the saved
        if "lora_B" in name:                  # adapter's every tensor carries values that change the logits
            torch.nn.init.normal_(p, std=0.02)
    return model


def arguments(out: str, rows: int, bf16: bool = False) -> object:
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=out, per_device_train_batch_size=rows, max_steps=STEPS, learning_rate=1e-2,
                             warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1,
                             save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
                             train_sampling_strategy="sequential", bf16=bf16)


def char_tokenizer() -> object:
    """Printable ASCII, one token a character (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(i): i - 29 for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def text_lines() -> object:
    import datasets

    from zeropp.tools.demo.data import load_corpus
    lines = [line for line in load_corpus().decode("utf-8", "replace").splitlines() if len(line) > 20][:64]
    return datasets.Dataset.from_dict({"text": lines})


def sft_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0, eos_token_id=1, bos_token_id=1))


def lora_config() -> object:
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def sft(out: str, rows: int, zeropp: bool, peft: bool = False) -> list[tuple[float, float]]:
    """TRL's SFTTrainer on its defaults (``gradient_checkpointing=True``); ``peft``: with ``peft_config=``, and
    the adapter saved under ``out``/adapter."""
    from trl import SFTConfig, SFTTrainer

    from zeropp.hf import ZeroppTrainer

    class ZeroppSFTTrainer(ZeroppTrainer, SFTTrainer):  # the one line a TRL recipe changes (docs/hf.md)
        pass

    args = SFTConfig(output_dir=out, per_device_train_batch_size=rows, max_steps=3, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True,
                     max_length=48, train_sampling_strategy="sequential", bf16=False, seed=0)
    assert args.gradient_checkpointing  # TRL's default, kept
    kw = dict(model=sft_llama(), args=args, train_dataset=text_lines(), processing_class=char_tokenizer())
    if peft:
        kw["peft_config"] = lora_config()
    trainer = ZeroppSFTTrainer(**kw, zeropp_config=copy.deepcopy(PLAIN)) if zeropp else SFTTrainer(**kw)
    trainer.train()
    if peft:
        trainer.save_model(os.path.join(out, "adapter"))
        if zeropp:  # the engine's own weights, to compare the saved adapter's logits with
            _SFT_STATE.append(trainer.engine.consolidated_state_dict())
    return history(trainer)


_SFT_STATE: list = []


def preferences() -> object:
    import datasets
    rows = {"prompt": ["To be or", "Fair is foul", "Double double", "The quality of"] * 8,
            "chosen": [" not to be", " and foul is fair", " toil and trouble", " mercy is not strained"] * 8,
            "rejected": [" a cat", " and so on", " rain", " soup"] * 8}
    return datasets.Dataset.from_dict(rows)


def dpo(out: str, rows: int, zeropp: bool, plus: bool = False, peft: bool = False) -> dict:
    """TRL's DPOTrainer, the reference model given (TRL would load one by name); with zeropp mixed in, stage 3
    partitions the reference too (``plus``: ZeRO++ in bf16, the reference's weights kept as int8)."""
    from trl import DPOConfig, DPOTrainer

    from zeropp.hf import ZeroppTrainer

    class ZeroppDPOTrainer(ZeroppTrainer, DPOTrainer):
        pass

    args = DPOConfig(output_dir=out, per_device_train_batch_size=rows, max_steps=3, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True,
                     max_length=48, train_sampling_strategy="sequential", bf16=plus, seed=0)
    kw = dict(model=sft_llama(), ref_model=sft_llama(), args=args, train_dataset=preferences(),
              processing_class=char_tokenizer())
    if peft:  # no reference model: TRL's reference is the policy with its adapter disabled
        kw.update(ref_model=None, peft_config=lora_config())
        args.gradient_checkpointing = True
    cfg = copy.deepcopy(PLUS if plus else PLAIN)
    trainer = ZeroppDPOTrainer(**kw, zeropp_config=cfg) if zeropp else DPOTrainer(**kw)
    trainer.train()
    if peft:
        return {"history": history(trainer)}
    ref = trainer.ref_model
    out = {"history": history(trainer), "ref_bytes_between_passes": sum(p.untyped_storage().nbytes()
                                                                          for p in ref.parameters())}
    if zeropp:
        out["ref_master_bytes"] = ref.model_state_bytes()["master_fp32"]
        out["ref_int8_bytes"] = ref.model_state_bytes().get("frozen_quantized", 0)
        out["ref_full_bytes"] = sum(p.numel() * 4 for p in ref.parameters())
    return out


def reward_length(completions: list, **kwargs: object) -> list[float]:
    """A Python reward: completions of 8 characters score best."""
    return [-abs(len(c) - 8) / 8.0 for c in completions]


def grpo(out: str, gather: bool = True) -> dict:
    """TRL's GRPOTrainer with ZeroppTrainer mixed in, on its defaults (activation checkpointing on), generating
    with the model's own ``generate`` through what ``accelerator.unwrap_model`` returns; ``gather``: TRL's
    ``ds3_gather_for_generation``. The bytes each ``generate`` call gathered are recorded."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from zeropp.hf import ZeroppTrainer, adapters

    plain_generate, gathered = adapters.EngineModule.generate, []

    def counted(self: object, *args: object, **kwargs: object) -> object:
        total = lambda: sum(sum(v.values()) for v in self._engine.ledger.current_report().values())  # noqa: E731
        before = total()
        result = plain_generate(self, *args, **kwargs)
        gathered.append(total() - before)
        return result

    class ZeroppGRPOTrainer(ZeroppTrainer, GRPOTrainer):
        pass

    prompts = datasets.Dataset.from_dict({"prompt": ["To be or", "Fair is foul", "Double double", "The quality of"] * 8})
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", use_cpu=True, report_to=[],
                      disable_tqdm=True, seed=0, bf16=False, ds3_gather_for_generation=gather)
    assert args.gradient_checkpointing
    trainer = ZeroppGRPOTrainer(model=sft_llama(), reward_funcs=reward_length, args=args, train_dataset=prompts,
                                processing_class=char_tokenizer(), zeropp_config=copy.deepcopy(PLAIN))
    adapters.EngineModule.generate = counted
    try:
        trainer.train()
    finally:
        adapters.EngineModule.generate = plain_generate
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": [(h["loss"], float(h["grad_norm"]), h["reward"]) for h in logs], "gathered": gathered,
            "model_bytes": sum(4 * p.numel() for p in trainer.engine.module.parameters()),
            "attributes": {name: getattr(unwrapped, name) == getattr(trainer.engine.module, name)
                           for name in ("is_gradient_checkpointing", "config", "generation_config", "can_generate")}}


def history(trainer: object) -> list[tuple[float, float]]:
    return [(h["loss"], float(h["grad_norm"])) for h in trainer.state.log_history if "loss" in h]  # type: ignore


def run(rank: int, world: int, root: str) -> dict:
    from zeropp.tools.demo.data import CorpusWindows
    from zeropp.hf import ZeroppTrainer
    out = {}
    for name, cfg in (("plain", PLAIN), ("plus", PLUS)):
        model = lora_llama()
        trainer = ZeroppTrainer(model=model, args=arguments(os.path.join(root, name), MICRO, bf16=name == "plus"),
                                train_dataset=CorpusWindows(32, 256), zeropp_config=copy.deepcopy(cfg))
        trainer.train()
        adapter = os.path.join(root, f"{name}_adapter")
        trainer.save_model(adapter)
        state = trainer.engine.consolidated_state_dict()
        out[name] = {"history": history(trainer), "adapter": adapter, "state": state if rank == 0 else None,
                     "frozen_int8": trainer.engine.model_state_bytes().get("frozen_quantized", 0),
                     "trained": sum(p.numel() for group in trainer.engine.optimizer.param_groups
                                    for p in group["params"])}
    out["sft"] = sft(os.path.join(root, "sft"), MICRO, zeropp=True)
    out["sft_lora"] = sft(os.path.join(root, "sft_lora"), MICRO, zeropp=True, peft=True)
    out["sft_lora_adapter"] = os.path.join(root, "sft_lora", "adapter")
    out["sft_lora_state"] = _SFT_STATE.pop() if rank == 0 else None
    out["dpo_lora"] = dpo(os.path.join(root, "dpo_lora"), MICRO, zeropp=True, peft=True)
    out["grpo"] = grpo(os.path.join(root, "grpo"))
    out["grpo_per_token"] = grpo(os.path.join(root, "grpo_per_token"), gather=False)
    out["dpo"] = dpo(os.path.join(root, "dpo"), MICRO, zeropp=True)
    out["dpo_int8"] = dpo(os.path.join(root, "dpo_int8"), MICRO, zeropp=True, plus=True)
    return out


@functools.lru_cache(maxsize=None)
def results(root: str) -> list:
    return run_world(run, RANKS, root)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list:
    return results(str(tmp_path_factory.mktemp("peft")))


@functools.lru_cache(maxsize=None)
def reference(root: str) -> list[tuple[float, float]]:
    """The plain Trainer in this process, on the same rows per step (the 4 ranks' micro-batches in one)."""
    import transformers

    from zeropp.tools.demo.data import CorpusWindows
    trainer = transformers.Trainer(model=lora_llama(), args=arguments(root, MICRO * RANKS),
                                   train_dataset=CorpusWindows(32, 256))
    trainer.train()
    return history(trainer)


def adapter_logits(state: dict, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of a fresh LoRA model given the engine's consolidated state, of the saved adapter loaded with
    PEFT on the base that state holds: the original one, or with an int8 base its dequantized values, which
    are what the engine computed with)."""
    from peft import PeftModel
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    want = lora_llama()
    want.load_state_dict(state)
    base = base_llama()
    base.load_state_dict({k.removeprefix("base_model.model.").replace(".base_layer", ""): v
                          for k, v in state.items() if "lora_" not in k})
    got = PeftModel.from_pretrained(base, adapter)
    want.eval(), got.eval()
    with torch.no_grad():
        return want(x).logits, got(x).logits


def test_plain_stage3_lora_matches_the_plain_trainer(world: list, tmp_path_factory: pytest.TempPathFactory) -> None:
    want = reference(str(tmp_path_factory.mktemp("peft_reference")))
    got = world[0]["plain"]["history"]
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"
    assert got[-1][0] < got[0][0]


def test_zeropp_with_an_int8_frozen_base_stays_within_two_percent(world: list) -> None:
    plain, plus = world[0]["plain"], world[0]["plus"]
    assert plus["frozen_int8"] > 0 and plain["frozen_int8"] == 0  # the base is kept as int8 rows
    assert plus["trained"] == plain["trained"] < 1000  # only the adapters have optimizer state (this rank's part)
    for (p, _), (q, _) in zip(plus["history"], plain["history"]):
        assert p == pytest.approx(q, rel=0.02)


@pytest.mark.parametrize("name", ["plain", "plus"])
def test_the_saved_adapter_loads_in_a_plain_process_to_the_engines_logits(world: list, name: str) -> None:
    run_ = world[0][name]
    assert sorted(os.listdir(run_["adapter"]))[:2] == ["README.md", "adapter_config.json"]
    want, got = adapter_logits(run_["state"], run_["adapter"])
    assert torch.equal(want, got)


def test_trls_sft_trainer_with_zeropp_mixed_in_matches_trls_own(world: list,
                                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    want = sft(str(tmp_path_factory.mktemp("sft_reference")), MICRO * RANKS, zeropp=False)
    got = world[0]["sft"]
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"


def test_trls_sft_trainer_with_a_lora_adapter_and_checkpointing_matches_trls_own(
        world: list, tmp_path_factory: pytest.TempPathFactory) -> None:
    """TRL's defaults, ``peft_config=`` and ``gradient_checkpointing=True``: the recipe that died with SIGSEGV. The
    adapter ``save_model`` wrote loads in this plain process to the logits of TRL's own run's adapter."""
    from peft import PeftModel
    root = str(tmp_path_factory.mktemp("sft_lora_reference"))
    want = sft(root, MICRO * RANKS, zeropp=False, peft=True)
    got = world[0]["sft_lora"]
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"
    x = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = []
    for where in (root, os.path.dirname(world[0]["sft_lora_adapter"])):
        model = PeftModel.from_pretrained(sft_llama(), os.path.join(where, "adapter")).eval()
        with torch.no_grad():
            logits.append(model(x).logits)
    assert not torch.equal(logits[0], sft_llama().eval()(x).logits)  # the adapter changes the logits
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    from peft import get_peft_model
    engine_model = get_peft_model(sft_llama(), lora_config())  # the engine's weights, all of them
    engine_model.load_state_dict(world[0]["sft_lora_state"])
    with torch.no_grad():
        assert torch.equal(engine_model.eval()(x).logits, logits[1])


def test_trls_dpo_trainer_with_a_lora_policy_matches_trls_own(world: list,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """A LoRA policy without a reference model: TRL computes the reference with the adapter disabled."""
    want = dpo(str(tmp_path_factory.mktemp("dpo_lora_reference")), MICRO * RANKS, zeropp=False, peft=True)["history"]
    got = world[0]["dpo_lora"]["history"]
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
        assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"


def test_trls_grpo_trainer_generates_and_steps_through_the_engine(world: list) -> None:
    """Online RL's first blocker: TRL read ``is_gradient_checkpointing`` on what ``unwrap_model`` returned (the
    engine's module), which now answers the model's attributes as the model does."""
    for res in world:
        got = res["grpo"]
        assert all(got["attributes"].values()), got["attributes"]
        assert len(got["steps"]) == 2
        for loss, grad_norm, reward in got["steps"]:
            assert math.isfinite(loss) and math.isfinite(grad_norm) and grad_norm > 0, got["steps"]
            assert -1.0 <= reward <= 0.0
    assert all(res["grpo"]["steps"] == world[0]["grpo"]["steps"] for res in world)  # the ranks agree


def test_grpo_honours_ds3_gather_for_generation_under_the_mixin(world: list) -> None:
    """True (TRL's default): each ``generate`` gathers the model once, about its fp32 bytes less this rank's
    quarter; False: every new token's forward gathers the units again, several times the bytes. The same
    generations and steps either way."""
    for res in world:
        whole, per_token = res["grpo"], res["grpo_per_token"]
        assert whole["gathered"] and len(whole["gathered"]) == len(per_token["gathered"])
        for once, again in zip(whole["gathered"], per_token["gathered"]):
            assert 0.5 * whole["model_bytes"] <= once <= whole["model_bytes"], (once, whole["model_bytes"])
            assert again > 3 * once, (again, once)
        assert whole["steps"] == per_token["steps"]


def test_trls_dpo_trainer_partitions_the_reference_and_matches_trls_own(world: list,
                                                                       tmp_path_factory: pytest.TempPathFactory
                                                                       ) -> None:
    want = dpo(str(tmp_path_factory.mktemp("dpo_reference")), MICRO * RANKS, zeropp=False)["history"]
    for res in world:
        got = res["dpo"]
        assert got["ref_bytes_between_passes"] == 0  # the reference model is released between its forwards
        assert got["ref_master_bytes"] <= got["ref_full_bytes"] / RANKS + 4096  # each rank holds a quarter
        assert len(got["history"]) == len(want) == 3
        for step, (g, w) in enumerate(zip(got["history"], want)):
            assert g[0] == pytest.approx(w[0], rel=1e-5), f"step {step} loss"
            assert g[1] == pytest.approx(w[1], rel=1e-5), f"step {step} grad_norm"


def test_dpo_with_zeropp_keeps_the_reference_as_int8_shards(world: list, tmp_path_factory: pytest.TempPathFactory
                                                            ) -> None:
    """ZeRO++ with ``zero_quantized_nontrainable_weights``: the reference's weights are int8 rows (one byte
    per element of this rank's quarter, plus the blocks' scales), no fp32 copy of them, released between its
    forwards; the DPO losses stay within 2% of TRL's own fp32 run."""
    want = dpo(str(tmp_path_factory.mktemp("dpo_reference_int8")), MICRO * RANKS, zeropp=False)["history"]
    for res in world:
        got = res["dpo_int8"]
        quarter = got["ref_full_bytes"] / 4 / RANKS  # elements of a quarter, at one byte each
        assert got["ref_master_bytes"] == 0 and quarter <= got["ref_int8_bytes"] <= 1.1 * quarter + 4096
        assert got["ref_bytes_between_passes"] == 0
        assert len(got["history"]) == 3
        for step, (g, w) in enumerate(zip(got["history"], want)):
            assert g[0] == pytest.approx(w[0], rel=0.02), f"step {step} loss"
