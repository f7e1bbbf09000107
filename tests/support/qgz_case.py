"""Deterministic per-rank gradient buckets for checking qgZ against an exact reduce-scatter."""
from __future__ import annotations

import torch

SEGMENTS = (37, 2, 130, 6, 1, 64)  # odd, tiny and block-straddling chunk lengths
BLOCK = 32


def bucket_for(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s ``[world, L]`` bucket: normal values, scaled per segment, one outlier per segment."""
    g = torch.Generator().manual_seed(7 + rank)
    cols = []
    for i, n in enumerate(SEGMENTS):
        x = torch.randn(world, n, generator=g) * (10.0 ** (i % 3 - 1))
        x[:, 0] *= 8  # an outlier at the start of each segment
        cols.append(x)
    return torch.cat(cols, dim=1).to(dtype)


def exact_mean(world: int, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 mean over ranks of every rank's bucket: row r is what rank r must end with."""
    return sum(bucket_for(p, world, dtype).float() for p in range(world)) / world
