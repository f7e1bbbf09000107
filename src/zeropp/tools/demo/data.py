"""The demo corpus, a byte-level tokenizer, and deterministic batches.

The corpus is public-domain Shakespeare shipped inside the package (see
``data/SOURCE.md``); nothing is downloaded. Tokens are raw bytes (vocabulary
of 256), so there is no tokenizer file either.

Batches are a pure function of ``(seed, step)``: the *global* batch for a
step is drawn once with a generator seeded from both, and each rank takes
its contiguous slice of rows. Concatenating the slices of all ranks in rank
order gives exactly the single-process global batch, which is what the
data-parallel parity tests rely on.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from importlib import resources

import torch

__all__ = [
    "load_corpus",
    "ByteTokenizer",
    "corpus_tokens",
    "train_val_split",
    "get_batch",
]

_DATA_PACKAGE = "zeropp.tools.demo"
_DATA_DIR = "data"
_SEPARATOR = b"\n\n"


@lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """All shipped ``data/*.txt`` files, in sorted name order, joined by a blank line."""
    folder = resources.files(_DATA_PACKAGE).joinpath(_DATA_DIR)
    texts = sorted(
        (entry for entry in folder.iterdir() if entry.is_file() and entry.name.endswith(".txt")),
        key=lambda entry: entry.name,
    )
    if not texts:
        raise FileNotFoundError(f"no .txt corpus files found in {_DATA_PACKAGE}/{_DATA_DIR}")
    return _SEPARATOR.join(entry.read_bytes().strip(b"\n") for entry in texts) + b"\n"


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def corpus_tokens() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values (a fresh tensor each call)."""
    data = load_corpus()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def train_val_split(
    tokens: torch.Tensor, val_fraction: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into (train, val): the last ``val_fraction`` is held out."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _step_seed(seed: int, step: int) -> int:
    """Mix (seed, step) into one 63-bit seed (splitmix64 finaliser), so nearby
    seeds and steps give unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return z & ((1 << 63) - 1)


def get_batch(
    tokens: torch.Tensor,
    step: int,
    global_batch: int,
    block_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch for ``step``.

    The global batch has ``global_batch`` rows at random offsets ``o`` into
    ``tokens`` (drawn with a ``torch.Generator`` seeded from ``seed`` and
    ``step``): ``x = tokens[o:o+block_size]``, ``y = tokens[o+1:o+block_size+1]``.
    Rank ``r`` gets rows ``[r*m, (r+1)*m)`` with ``m = global_batch // world_size``.
    Returns int64 tensors ``(x, y)`` of shape ``[m, block_size]`` on ``tokens.device``.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if global_batch <= 0 or block_size <= 0:
        raise ValueError(
            f"global_batch ({global_batch}) and block_size ({block_size}) must be positive"
        )
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if global_batch % world_size != 0:
        raise ValueError(
            f"global_batch ({global_batch}) is not divisible by world_size ({world_size})"
        )
    n = tokens.numel()
    if n < block_size + 1:
        raise ValueError(f"corpus of {n} tokens is too short for block_size {block_size}")

    g = torch.Generator(device="cpu")
    g.manual_seed(_step_seed(seed, step))
    # All global offsets are drawn on every rank so each rank's slice is the
    # same as in a single-process run.
    offsets = torch.randint(0, n - block_size, (global_batch,), generator=g)
    m = global_batch // world_size
    mine = offsets[rank * m : (rank + 1) * m].to(tokens.device)
    idx = mine[:, None] + torch.arange(block_size, device=tokens.device)[None, :]
    x = tokens[idx].long()
    y = tokens[idx + 1].long()
    return x, y


class CorpusWindows(torch.utils.data.Dataset):
    """``count`` evenly spaced windows of ``block`` tokens of the shipped corpus, as Hugging Face batches:
    ``{"input_ids", "labels"}`` with the labels equal to the inputs (causal LM heads shift them)."""

    def __init__(self, block: int, count: int) -> None:
        tokens = corpus_tokens()
        stride = (len(tokens) - block) // count
        self.rows = torch.stack([tokens[i * stride: i * stride + block] for i in range(count)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}
