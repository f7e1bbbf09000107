"""Forwards recomputed in backward (activation checkpointing) on models with frozen weights, 2 nodes x 2 ranks.

A LoRA fine-tune with activation checkpointing, TRL's default, killed every rank with SIGSEGV: the recomputed
forward read a released frozen weight through a native kernel, because the watches were off for the whole
backward (Note [watches stay on] in ``zero/idle_watch.py``). Each cell here trains 3 steps and compares its
losses with the same model, config and batches without checkpointing: plain stage 3 and parameter offload in
fp32 to 1e-6, ZeRO++ in bf16 (int8 frozen weights) to 1e-3. Beside the matrix, both offloads on NVMe, where
units keep frozen and trainable parameters together (``MIXED``), to 1e-6.

``make test`` runs every value of every axis at least once (``CELLS``); the full product of models x
checkpointing x configs runs with ``pytest -m full_matrix tests/dist/test_recompute.py``.
"""
from __future__ import annotations

import copy
import functools
import itertools
import shutil
import tempfile
import types

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("trl")

from support.world import run_world  # noqa: E402

STEPS, ROWS, LEN = 3, 2, 12
CONFIGS = {
    "plain": ({"zero_optimization": {"stage": 3}}, 1e-6),
    "plus": ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                    "zero_quantized_gradients": True, "zero_quantized_nontrainable_weights": True},
              "bf16": {"enabled": True}}, 1e-3),
    "offload_param": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, 1e-6),
}
# not an axis of the matrix: both offloads on NVMe, where units keep frozen and trainable parameters together (a
# gradient record each), which are released as frozen units are (Note [frozen units in backward])
NVME = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ""},
                              "offload_optimizer": {"device": "nvme", "nvme_path": ""}}}
CHECKPOINTING = ["hf_reentrant", "hf_nonreentrant", "hf_offload", "torch_block", "zeropp_cpu", "trl_offload"]
MODELS = ["lora_llama", "gpt2_frozen", "t5_frozen_encoder"]
# every value of every axis at least once
CELLS = [("lora_llama", "hf_reentrant", "plain"), ("lora_llama", "hf_nonreentrant", "plus"),
         ("gpt2_frozen", "torch_block", "offload_param"), ("gpt2_frozen", "hf_offload", "plain"),
         ("t5_frozen_encoder", "zeropp_cpu", "plus"), ("lora_llama", "trl_offload", "offload_param")]
FULL = list(itertools.product(MODELS, CHECKPOINTING, CONFIGS))
# T5's shared embedding is a persistent unit read twice in a row: a prefetch of it while it was being gathered read
# its NVMe shard after the first gather let it go (SIGSEGV in gloo on ranks of 2 x 2)
MIXED = [("lora_llama", how, "nvme") for how in ("hf_nonreentrant", "trl_offload")] + \
    [("gpt2_frozen", "hf_reentrant", "nvme"), ("t5_frozen_encoder", "hf_nonreentrant", "nvme")]


def lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # LoRA's B starts at zero: off zero, every adapter weight moves the loss
            torch.nn.init.normal_(p, std=0.02)
    return model


def gpt2_frozen() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                       tie_word_embeddings=False))
    for name, p in model.named_parameters():
        if name.startswith(("transformer.wte", "transformer.wpe")) or ".ln_" in name or "ln_f" in name:
            p.requires_grad_(False)
    return model


def t5_frozen_encoder() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0))
    for name, p in model.named_parameters():
        if name.startswith("encoder.") and "shared" not in name:
            p.requires_grad_(False)
    return model


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and any(True for _ in mod[0].parameters()):
            return mod
    raise AssertionError("no block list")


def _checkpoint_first_block(model: torch.nn.Module, checkpoint: object) -> None:
    """Research code's way: one block's forward through a checkpoint function (its hooks stay outside)."""
    block = _blocks(model)[0]
    inner = block.forward

    def forward(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        return checkpoint(functools.partial(inner, **kwargs), *args)
    block.forward = types.MethodType(forward, block)


def enable(model: torch.nn.Module, how: str) -> object:
    """Turn ``how``'s checkpointing on; returns a context for forward and backward (TRL's offloading)."""
    import contextlib
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if how in ("hf_reentrant", "trl_offload"):  # transformers' older name, as TRL calls it
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "hf_reentrant"})
        if how == "hf_reentrant":  # what the Trainer does for a model with frozen inputs
            hf.enable_input_require_grads()
    elif how == "hf_nonreentrant":  # transformers 5's name
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif how == "hf_offload":
        import transformers.modeling_utils as mu
        from torch.autograd.graph import save_on_cpu
        # transformers pins the host copies unconditionally, which a CPU-only torch refuses (without zeropp
        # too); unpinned, its saved-tensor hooks are the same ones
        mu.save_on_cpu = lambda pin_memory, device_type: save_on_cpu(pin_memory=False, device_type=device_type)
        hf.activation_checkpointing_enable(offload=True)
    elif how == "torch_block":
        from torch.utils.checkpoint import checkpoint
        _checkpoint_first_block(model, functools.partial(checkpoint, use_reentrant=False))
    elif how == "zeropp_cpu":
        from zeropp import checkpointing
        checkpointing.configure(checkpoint_in_cpu=True)
        _checkpoint_first_block(model, checkpointing.checkpoint)
    if how == "trl_offload":
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
        # TRL's offloading asks torch for the accelerator and its streams; here the host plays it, so its
        # hooks copy saved activations to unpinned host memory in order (no streams) and nest with ours
        torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
        return get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False)
    return contextlib.nullcontext()


def batches(model_name: str, rank: int, world: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, 64, (ROWS * world, LEN), generator=g)[rank * ROWS:(rank + 1) * ROWS]
        if model_name == "t5_frozen_encoder":
            out.append({"input_ids": ids, "labels": ids.flip(1)[:, : LEN // 2].contiguous()})
        else:
            out.append({"input_ids": ids, "labels": ids})
    return out


def run_cell(rank: int, world: int, model_name: str, how: str, config: str) -> list[float]:
    import zeropp
    model = globals()[model_name]()
    model.train()
    context = enable(model, how) if how != "none" else None
    cfg = {**copy.deepcopy(NVME if config == "nvme" else CONFIGS[config][0]), "train_micro_batch_size_per_gpu": ROWS,
           "topology": {"ranks_per_node": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    scratch = tempfile.mkdtemp(prefix="zeropp-recompute-")
    for section in ("offload_param", "offload_optimizer"):
        offload = cfg["zero_optimization"].get(section, {})
        if offload.get("device") == "nvme":
            offload["nvme_path"] = scratch
    engine, *_ = zeropp.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=cfg)
    losses = []
    try:
        for batch in batches(model_name, rank, world):
            import contextlib
            with context if context is not None else contextlib.nullcontext():
                loss = engine(**batch).loss
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.destroy()
        shutil.rmtree(scratch, ignore_errors=True)
        if how == "zeropp_cpu":
            from zeropp import checkpointing
            checkpointing.reset()
    return losses


def cells(rank: int, world: int, chosen: list) -> dict:
    refs = {(m, c) for m, _, c in chosen}
    out = {("none", m, c): run_cell(rank, world, m, "none", c) for m, c in sorted(refs)}
    for m, how, c in chosen:
        out[(how, m, c)] = run_cell(rank, world, m, how, c)
    return out


@functools.lru_cache(maxsize=None)
def results(which: str) -> list:
    return run_world(cells, 4, {"cells": CELLS + MIXED, "full": FULL}[which], ranks_per_node=2)


def _check(cell: tuple, res: list) -> None:
    model, how, config = cell
    tol = 1e-6 if config == "nvme" else CONFIGS[config][1]
    for rank, out in enumerate(res):
        ref, got = out[("none", model, config)], out[(how, model, config)]
        assert len(got) == STEPS and all(map(lambda v: v == v, got)), f"rank {rank}: {got}"
        assert max(abs(a - b) for a, b in zip(ref, got)) <= tol, f"rank {rank} {cell}: {got} vs {ref}"
    assert res[0][("none", model, config)][-1] != res[0][("none", model, config)][0]  # it trained


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(c) for c in CELLS])
def test_recomputed_forward_matches_the_run_without_checkpointing(cell: tuple) -> None:
    _check(cell, results("cells"))


@pytest.mark.parametrize("cell", MIXED, ids=["-".join(c) for c in MIXED])
def test_units_with_frozen_and_trainable_parameters_stay_for_the_inputs_gradient(cell: tuple) -> None:
    _check(cell, results("cells"))


@pytest.mark.full_matrix
@pytest.mark.parametrize("cell", FULL, ids=["-".join(c) for c in FULL])
def test_full_matrix(cell: tuple) -> None:
    _check(cell, results("full"))


# the cells where a recomputed forward reads released frozen weights, on a torch without
# torch.overrides.redispatch_function (before 2.13; Note [torch without one-hop skip] in zero/idle_watch.py)
BEFORE_SKIP = [("lora_llama", "hf_nonreentrant", "plus"), ("lora_llama", "hf_reentrant", "plain"),
               ("gpt2_frozen", "torch_block", "offload_param")]


def cells_before_one_hop_skip(rank: int, world: int, chosen: list) -> dict:
    del torch.overrides.redispatch_function  # this rank's torch, as one before 2.13
    return cells(rank, world, chosen)


@pytest.mark.parametrize("cell", BEFORE_SKIP, ids=["-".join(c) for c in BEFORE_SKIP])
def test_recompute_on_a_torch_without_one_hop_skip(cell: tuple) -> None:
    _check(cell, run_world(cells_before_one_hop_skip, 4, [cell], ranks_per_node=2))
