"""Online RL through zeropp: TRL's ``GRPOTrainer`` (generation inside every step, a Python reward) on 2 nodes x 2
ranks at stage 3, fp32, sampled generation with the same seeds, against the same trainer under DDP on the same 4
ranks: each step's loss, mean reward and gradient norm to 1e-5, for 3 steps.

Both roads: ``ZeroppTrainer`` mixed in (``zeropp_config=``), and the DeepSpeed road (``GRPOConfig(deepspeed=...)``
with the alias), where TRL's ``unwrap_model_for_generation`` gathers the model and takes DeepSpeed's stage-3 hooks
off for the generation (``optimizer.parameter_offload``: ``runtime/zero/parameter_offload.py``). Full fine-tune
and LoRA; ``beta`` 0 and ``beta`` 0.1 (a reference model loaded by name, partitioned like the policy);
``ds3_gather_for_generation`` false (per-unit gathers inside ``generate``). With ZeRO++ (qwZ, hpZ, qgZ) the
rewards and losses stay within 2% of DDP's. Every step's rewards differ within some group (TRL's
``frac_reward_zero_std`` < 1): the advantages are not all zero.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import pytest

from support.matrix import Cases
from support.world import run_world

# not imported here: a rank imports this module before it installs the alias, and trl imports accelerate,
# which decides at import whether DeepSpeed is there
pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("peft") is None,
                                reason="needs trl and peft (the dev extra)")

RANKS, STEPS = 4, 3
PLAIN = {"zero_optimization": {"stage": 3}, "topology": {"ranks_per_node": 2}}
PLUS = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                              "zero_quantized_gradients": True}, "topology": {"ranks_per_node": 2}}
ROAD = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", **PLAIN}
# (name, road, config, LoRA, beta, gather for generation); DDP's references: ("ddp", ...) with no config
CASES = [
    ("road_full_beta0", "deepspeed", ROAD, False, 0.0, True),
    ("road_full_beta", "deepspeed", ROAD, False, 0.1, True),
    ("road_lora_beta", "deepspeed", ROAD, True, 0.1, True),
    ("road_full_per_unit", "deepspeed", ROAD, False, 0.0, False),
    ("mixin_full_beta", "mixin", PLAIN, False, 0.1, True),
    ("mixin_lora_beta0", "mixin", PLAIN, True, 0.0, True),
    ("mixin_plus", "mixin", PLUS, False, 0.0, True),
]
# every road, LoRA or not, beta, gather and config in make test; every case under full_matrix
RUN = Cases(CASES, [lambda c: c[1], lambda c: c[3], lambda c: c[4], lambda c: c[5], lambda c: id(c[2])])


def reward(completions: list[str], **_: object) -> list[float]:
    """Vowels per completion: a reward a random policy's samples differ in."""
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]


def grpo(root: str, name: str, road: str, config: dict | None, lora: bool, beta: float, gather: bool) -> list:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from test_hf_peft import lora_config
    prompts = datasets.Dataset.from_dict({"prompt": ["To be or", "Fair is foul", "Double double",
                                                     "The quality of"] * 8})
    args = GRPOConfig(output_dir=os.path.join(root, name), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=8, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True, seed=0, bf16=False,
                      beta=beta, ds3_gather_for_generation=gather,
                      deepspeed=dict(config) if road == "deepspeed" else None)
    kw = {"model": os.path.join(root, "model"), "reward_funcs": reward, "args": args, "train_dataset": prompts}
    if lora:
        kw["peft_config"] = lora_config()
    if road == "mixin":
        from zeropp.hf import ZeroppTrainer

        class ZeroppGRPOTrainer(ZeroppTrainer, GRPOTrainer):
            pass
        trainer = ZeroppGRPOTrainer(**kw, zeropp_config=dict(config))
    else:
        trainer = GRPOTrainer(**kw)
    trainer.train()
    keys = ("loss", "reward", "grad_norm", "frac_reward_zero_std")
    return [tuple(float(h[k]) for k in keys) for h in trainer.state.log_history if "loss" in h]


def generation_bytes() -> dict:
    """Bytes this rank receives for one generation's whole-model gather (Note [generation gathers]), bf16, without
    and with qwZ (and hpZ), by the ledger; and a bound of live elements under the model: a warning, per-unit
    gathers, the same tokens."""
    import warnings

    import torch

    import zeropp
    from test_hf_peft import sft_llama
    out, tokens = {}, {}
    ids = torch.tensor([[5, 6, 7, 8]])
    for name, extra in (("plain", {}), ("qwz", {"zero_quantized_weights": True}),
                        ("qwz_hpz", {"zero_quantized_weights": True, "zero_hpz_partition_size": 2}),
                        ("bounded", {"stage3_max_live_parameters": 1000})):
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
               "zero_optimization": {"stage": 3, **extra}}
        engine, *_ = zeropp.initialize(model=sft_llama(), config=cfg)
        total = lambda: sum(sum(v.values()) for v in engine.ledger.current_report().values())  # noqa: E731
        inter = lambda: sum(v["inter_node_bytes"] for v in engine.ledger.current_report().values())  # noqa: E731
        before, inter_before = total(), inter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with engine.held_whole():
                entered = total() - before
                tokens[name] = engine.module.generate(ids, max_new_tokens=6, do_sample=False).tolist()
        out[name] = {"entry": entered, "all": total() - before, "inter": inter() - inter_before,
                     "gathered_peak": engine.memory_report()["gathered_weights_peak"],
                     "whole": sum(s.spec.padded for u in engine.units for s in u.slots) * 2,  # bf16 bytes
                     "released": all(u.state.name == "SHARDED" for u in engine.units),
                     "warned": [str(w.message) for w in caught if "stage3_max_live_parameters" in str(w.message)]}
        engine.destroy()
    out["same_tokens"] = tokens["plain"] == tokens["bounded"]
    return out


def run(rank: int, world: int, root: str, cases: list[tuple]) -> dict:
    import zeropp
    zeropp.install_deepspeed_alias()  # before transformers, for the DeepSpeed road's cases (run last)
    import torch.distributed as dist

    from test_hf_peft import char_tokenizer, sft_llama
    if rank == 0:  # by name, so that TRL loads the reference model (beta > 0) as it loads the policy
        sft_llama().save_pretrained(os.path.join(root, "model"))
        char_tokenizer().save_pretrained(os.path.join(root, "model"))
    dist.barrier()
    out = {("ddp", lora, beta): grpo(root, f"ddp_{lora}_{beta}", "ddp", None, lora, beta, True)
           for lora, beta in sorted({(lora, beta) for _, _, _, lora, beta, _ in cases})}
    out["generation_bytes"] = generation_bytes()
    # the DeepSpeed road last: TrainingArguments(deepspeed=...) switches accelerate to DeepSpeed for the process
    for name, road, config, lora, beta, gather in sorted(cases, key=lambda c: c[1] == "deepspeed"):
        out[name] = grpo(root, name, road, config, lora, beta, gather)
    return out


@functools.lru_cache(maxsize=None)
def results(root: str) -> list:
    return run_world(run, RANKS, root, RUN.cells(), ranks_per_node=2, env={"ZEROPP_FRESH_INTERPRETER": "1"},
                     timeout=900)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list:
    return results(str(tmp_path_factory.mktemp("grpo")))


@pytest.mark.parametrize("case", RUN.params())
def test_grpo_matches_ddp(world: list, case: tuple) -> None:
    name, _, config, lora, beta, _ = case
    for rank in world:
        got, want = rank[name], rank[("ddp", lora, beta)]
        assert len(got) == len(want) == STEPS
        for step, (ours, theirs) in enumerate(zip(got, want)):
            assert ours[3] < 1.0 and theirs[3] < 1.0, f"step {step + 1}: every group's rewards equal"
            if config is PLUS:  # int8 weights: samples may differ, rewards and losses stay close
                assert ours[1] == pytest.approx(theirs[1], rel=0.02), f"step {step + 1}: reward"
                assert ours[0] == pytest.approx(theirs[0], rel=0.02, abs=1e-4), f"step {step + 1}: loss"
            else:
                assert ours[:3] == pytest.approx(theirs[:3], abs=1e-5), f"step {step + 1}: (loss, reward, grad norm)"


def test_a_generations_gather_moves_int8_with_qwz_and_is_released(world: list) -> None:
    for rank in world:
        got = rank["generation_bytes"]
        plain, qwz, hpz, bounded = got["plain"], got["qwz"], got["qwz_hpz"], got["bounded"]
        assert plain["entry"] > 0 and plain["all"] == plain["entry"] and plain["inter"] > 0  # once, on entry
        assert qwz["all"] == qwz["entry"] <= 0.55 * plain["entry"]  # int8 blocks
        # hpZ's intra-node copy is current after initialize (as between a forward and its backward): no byte
        # crosses nodes
        assert hpz["all"] == hpz["entry"] > 0 and hpz["inter"] == 0
        assert plain["released"] and qwz["released"] and hpz["released"] and bounded["released"]
        assert not plain["warned"] and len(bounded["warned"]) == 1 and "bytes of" in bounded["warned"][0]
        assert bounded["entry"] == 0 and bounded["all"] > plain["all"]  # per-unit gathers, for every token
        assert got["same_tokens"]
        # memory_report: generation held the model's 16-bit weights whole (bounded: never all at once)
        assert plain["gathered_peak"] == plain["whole"] and qwz["gathered_peak"] == qwz["whole"]
        assert 0 < bounded["gathered_peak"] < bounded["whole"]
