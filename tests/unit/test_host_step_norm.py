"""The host step's norm in pieces (Note [host step passes] in ``zero/optimizer_step.py``): the squared norm of a
16-bit gradient row read through two small buffers equals the norm of its whole fp32 conversion."""
from __future__ import annotations

import math

import torch

from zeropp.zero.optimizer_step import NORM_PIECE, squared_norm_in_pieces


def whole(row: torch.Tensor, unscale: float) -> torch.Tensor:
    return torch.linalg.vector_norm(row.to(torch.float32) * unscale, dtype=torch.float64).square()


def test_a_row_of_several_pieces_has_the_whole_rows_norm() -> None:
    row = torch.randn(2 * NORM_PIECE + 12345, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = squared_norm_in_pieces(row, 0.25)
    assert got.dtype == torch.float64
    assert math.isclose(got.item(), whole(row, 0.25).item(), rel_tol=1e-12)


def test_a_row_of_one_piece_has_the_very_same_norm() -> None:
    row = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    assert squared_norm_in_pieces(row, 1 / 1024).item() == whole(row, 1 / 1024).item()
    assert squared_norm_in_pieces(row[:0]).item() == 0.0


def test_a_non_finite_gradient_makes_the_norm_non_finite() -> None:
    row = torch.zeros(NORM_PIECE + 7, dtype=torch.bfloat16)
    row[-1] = float("inf")
    assert math.isinf(squared_norm_in_pieces(row).item())
    row[-1] = float("nan")
    assert math.isnan(squared_norm_in_pieces(row).item())
