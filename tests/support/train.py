"""Training loops shared by the distributed tests: the engine on each rank, and the single-process reference."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import zeropp
from support.models import TiedNet, rank_slice, tied_batch

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def config(global_batch: int, **zero: Any) -> dict:
    cfg = {"train_batch_size": global_batch, "optimizer": copy.deepcopy(ADAMW),
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 60, **zero}}
    return cfg


def train_engine(rank: int, world: int, cfg: dict, steps: int, global_batch: int, seed: int = 0,
                 **model_kwargs: int) -> dict:
    """Train TiedNet under the engine; losses are averaged over ranks (= the global-batch loss)."""
    torch.manual_seed(seed)
    engine, _, _, _ = zeropp.initialize(model=TiedNet(**model_kwargs), config=cfg)
    losses = []
    for step in range(steps):
        idx, tgt = tied_batch(step, global_batch, vocab=model_kwargs.get("vocab", 13))
        loss = engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world))
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return {
        "losses": losses,
        "state": engine.consolidated_state_dict(),
        "comm": engine.comm_report(),
        "memory": engine.model_state_bytes(),
        "numels": [p.numel() for p in engine.module.parameters()],
    }


def train_reference(steps: int, global_batch: int, autocast_bf16: bool = False, seed: int = 0) -> dict:
    """The same model, optimizer and global batches in one process (optionally under bf16 autocast)."""
    torch.manual_seed(seed)
    model = TiedNet()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW["params"])
    losses = []
    for step in range(steps):
        idx, tgt = tied_batch(step, global_batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def param_rel_error(state: dict, ref: dict) -> float:
    """||all parameters - reference|| / ||reference||, all parameters together."""
    num = sum(float((state[k].float() - ref[k].float()).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].float().pow(2).sum()) for k in ref)
    return (num / den) ** 0.5
