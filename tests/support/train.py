"""Training loops shared by the distributed tests: the engine on each rank, and the single-process reference."""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import zeropp
from support.models import TiedNet, rank_slice, tied_batch

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def config(global_batch: int, **zero: Any) -> dict:
    cfg = {"train_batch_size": global_batch, "optimizer": copy.deepcopy(ADAMW),
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 60, **zero}}
    return cfg


def train_steps(engine: Any, rank: int, world: int, steps: int, global_batch: int) -> list[float]:
    """``steps`` optimizer steps of TiedNet batches; returns the global-batch loss of each (mean over ranks)."""
    losses = []
    for step in range(steps):
        idx, tgt = tied_batch(step, global_batch)
        loss = engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world))
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def train_engine(rank: int, world: int, cfg: dict, steps: int, global_batch: int, seed: int = 0,
                 **model_kwargs: int) -> dict:
    """Train TiedNet under the engine; losses are averaged over ranks (= the global-batch loss)."""
    torch.manual_seed(seed)
    engine, _, _, _ = zeropp.initialize(model=TiedNet(**model_kwargs), config=cfg)
    gas = cfg.get("gradient_accumulation_steps", 1)
    micro = global_batch // gas
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for k in range(gas):
            idx, tgt = tied_batch(step * gas + k, micro, vocab=model_kwargs.get("vocab", 13))
            loss = engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world))
            engine.backward(loss)
            engine.step()
            value = loss.detach().float().reshape(1).clone()
            dist.all_reduce(value)
            total += value.item() / world
        losses.append(total / gas)
        norms.append(engine.get_global_grad_norm())
    idx, tgt = tied_batch(10_000, micro, vocab=model_kwargs.get("vocab", 13))
    engine.eval()
    with torch.no_grad():
        value = engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world)).float().reshape(1).clone()
    dist.all_reduce(value)
    engine.train()
    return {
        "losses": losses,
        "grad_norms": norms,
        "eval_loss": value.item() / world,
        "state": engine.consolidated_state_dict(),
        "comm": engine.comm_report(),
        "memory": engine.model_state_bytes(),
        "numels": [p.numel() for p in engine.module.parameters()],
    }


def train_reference(steps: int, global_batch: int, autocast_bf16: bool = False, seed: int = 0,
                    gas: int = 1, clip: float = 0.0,
                    make_optimizer: Optional[Callable[[torch.nn.Module], torch.optim.Optimizer]] = None) -> dict:
    """The same model, optimizer and global batches in one process (optionally under bf16 autocast).

    ``make_optimizer(model)`` replaces the default AdamW (``ADAMW``) when given.
    """
    torch.manual_seed(seed)
    model = TiedNet()
    opt = make_optimizer(model) if make_optimizer else torch.optim.AdamW(model.parameters(), **ADAMW["params"])
    micro = global_batch // gas
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for k in range(gas):
            idx, tgt = tied_batch(step * gas + k, micro)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
                loss = model(idx, tgt)
            (loss / gas).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    idx, tgt = tied_batch(10_000, micro)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        eval_loss = model(idx, tgt).item()
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def param_rel_error(state: dict, ref: dict) -> float:
    """||all parameters - reference|| / ||reference||, all parameters together."""
    num = sum(float((state[k].float() - ref[k].float()).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].float().pow(2).sum()) for k in ref)
    return (num / den) ** 0.5


def error_of(fn: Any) -> str:
    """``"Type: message"`` of what ``fn()`` raises (``"no error"`` if nothing): worlds return it for the test."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"
