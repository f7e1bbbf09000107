"""The three objects a ``transformers.Trainer`` loop holds — model, optimizer, scheduler — standing for one
:class:`~zeropp.zero.engine.ZeroEngine`.

The engine does the whole optimizer step (reduction, clipping, optimizer and scheduler) inside
``ZeroppTrainer.training_step``, as DeepSpeed's engine does inside accelerate's backward. The Trainer's loop
still calls ``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()`` afterwards: here those are
no-ops, so nothing steps, clips or clears twice.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from zeropp.zero.engine import ZeroEngine


class EngineModule(nn.Module):
    """The model as the Trainer's loop calls it: ``forward`` runs through the engine (stage 3 gathers each
    unit's weights just in time), so accelerate never wraps the model in DDP or patches its forward.

    The Hugging Face model is registered as ``module``: ``parameters()``, ``train()`` and ``eval()`` reach it.
    """

    def __init__(self, engine: ZeroEngine, gather_for_generation: bool = True) -> None:
        super().__init__()
        self.module = engine.module
        self.__dict__["_engine"] = engine  # not a child: the model is registered once, as `module`
        self.gather_for_generation = gather_for_generation

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate``. With ``gather_for_generation`` (TRL's ``ds3_gather_for_generation``, true by
        default) every unit is gathered once for the whole call (``engine.held_whole()``: collective, so every rank
        generates together, as TRL's trainers do); without it each forward of each new token gathers the units it
        runs, as a direct call of the model does (Note [direct calls])."""
        hold = self._engine.held_whole() if self.gather_for_generation else contextlib.nullcontext()
        with hold:
            return self.module.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The model's attributes, as trainers read them on what ``accelerator.unwrap_model`` returns
        (``is_gradient_checkpointing``, ``config``, ``generation_config``, ``generate``)."""
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules: `module`
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine owns the gradients (reduced into shards, cleared at each optimizer step)."""

    def _get_name(self) -> str:
        # The Trainer picks label smoothing's label shift by the model's class name (causal LMs shift).
        return self.module._get_name()


class PlainModule(nn.Module):
    """The model before the engine exists (``evaluate()`` before ``train()``): called as is, whole on every
    rank, and kept out of accelerate's ``prepare_model`` (which would patch the model's own forward)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _get_name(self) -> str:
        return self.module._get_name()


class EngineOptimizer:
    """``Trainer.optimizer``: the engine's optimizer (over this rank's fp32 master shards) for reading —
    ``param_groups``, ``state`` — whose ``step()`` and ``zero_grad()`` do nothing (the engine stepped it)."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer the engine steps."""
        return self.engine.master_optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.master_optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.engine.master_optimizer.state

    @property
    def defaults(self) -> dict:
        return self.engine.master_optimizer.defaults

    def step(self, closure: Any = None) -> None:
        """No-op: ``ZeroppTrainer.training_step`` ran the engine's step at the accumulation boundary."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine clears its gradient shards at each optimizer step."""

    def state_dict(self) -> dict:
        raise RuntimeError("ZeroppTrainer.optimizer.state_dict(): the optimizer state is sharded over the ranks; "
                           "Trainer checkpoints save it through the engine's checkpoint (save_strategy), or call "
                           "zeropp.checkpoint.save_checkpoint(trainer.engine, dir) on every rank")

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("ZeroppTrainer.optimizer.load_state_dict(): the optimizer state is sharded over the "
                           "ranks; resume with trainer.train(resume_from_checkpoint=...)")

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.engine.master_optimizer!r})"


class EngineScheduler:
    """``Trainer.lr_scheduler``: the engine steps the real scheduler after each optimizer step; ``step()`` here
    does nothing. ``get_last_lr()`` is the learning rate the last optimizer step used (what the Trainer logs
    for a step), recorded by :meth:`record_step_lr` just before the engine steps."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self._used: Optional[list[float]] = None

    @property
    def scheduler(self) -> Any:
        """The scheduler the engine steps (the config's, or the Trainer's built over the engine's optimizer)."""
        return self.engine.lr_scheduler

    def record_step_lr(self) -> None:
        """Remember the learning rates of the optimizer step about to run."""
        self._used = _lrs(self.engine)

    def get_last_lr(self) -> list[float]:
        return list(self._used) if self._used is not None else _lrs(self.engine)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the engine stepped the scheduler with the optimizer (and skips both on an fp16 overflow)."""

    def state_dict(self) -> dict:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def __repr__(self) -> str:
        return f"EngineScheduler({self.scheduler!r})"


def _lrs(engine: ZeroEngine) -> list[float]:
    """The learning rate of each of the engine's optimizer parameter groups."""
    return [group["lr"] for group in engine.master_optimizer.param_groups]
