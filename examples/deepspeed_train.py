"""A training script written against DeepSpeed's documented API; only the import names zeropp.

    torchrun --nproc-per-node 2 examples/deepspeed_train.py --deepspeed --deepspeed_config examples/ds_config.json

Everything below the import is what a DeepSpeed user already has: argparse with add_config_arguments,
init_distributed, zero.Init, initialize(args=..., training_data=...), the engine's forward/backward/step,
its accessors, save_checkpoint with client state, and save_16bit_model.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import zeropp as deepspeed  # the one changed line: was `import deepspeed`

VOCAB, SEQ = 64, 16


class TinyLM(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.scale = dim ** -0.5

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.norm(h) @ self.emb.weight.t() * self.scale  # weight tying by hand, as research code does
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Sequences(torch.utils.data.Dataset):
    """Deterministic token sequences whose next token follows a fixed rule (learnable)."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.data = (start + 3 * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--out", default=None, help="write the losses here as JSON (rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = TinyLM()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=Sequences())

    losses = []
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}", flush=True)
    assert engine.train_batch_size() == engine.train_micro_batch_size_per_gpu() * engine.world_size * \
        engine.gradient_accumulation_steps()
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"losses": losses})
        engine.save_16bit_model(args.save_dir, "model_16bit.bin")
    if args.out and engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "stage": engine.zero_optimization_stage(),
                       "world_size": engine.world_size}, f)


if __name__ == "__main__":
    main()
