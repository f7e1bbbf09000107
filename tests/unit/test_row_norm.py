"""The gradient row's squared norm (Note [row norm] in ``offload/row_norm.py``): the C kernel over host rows and
the torch path in pieces give the norm of the row's fp32 conversion times the unscale; the kernel's bits do not
depend on the thread count, and a 16-bit row gives the very bits of its unscaled fp32 copy (what the NVMe path
reads), so runs that must match bit for bit still do. An accelerator's rows take torch._foreach_norm in fp32."""
from __future__ import annotations

import math

import pytest
import torch

from zeropp.offload import row_norm
from zeropp.offload.row_norm import NORM_PIECE, squared_norm, squared_norm_in_pieces

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def whole(row: torch.Tensor, unscale: float) -> float:
    """The reference: fp32 conversion, the unscale in fp32, then an exactly rounded fp64 sum of squares."""
    x = (row.to(torch.float32) * unscale).double()
    return math.fsum((x * x).tolist())


def test_the_kernel_is_built_here() -> None:
    assert row_norm._kernel() is not None  # a C compiler is on this machine: the fast path must be in use


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_paths_give_the_rows_norm(dtype: torch.dtype) -> None:
    row = torch.randn(2 * NORM_PIECE + 12345, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = whole(row, 1 / 3)
    for got in (squared_norm(row, 1 / 3), squared_norm_in_pieces(row, 1 / 3)):
        assert got.dtype == torch.float64 and got.dim() == 0
        assert math.isclose(got.item(), ref, rel_tol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_16_bit_row_has_the_bits_of_its_unscaled_fp32_copy(dtype: torch.dtype) -> None:
    row = torch.randn(200_003, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert squared_norm(row, 1 / 3).item() == squared_norm(row.to(torch.float32) * (1 / 3)).item()


def test_the_kernels_bits_do_not_depend_on_the_thread_count() -> None:
    row = torch.randn(3_000_001, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = squared_norm(row, 0.5).item()
        torch.set_num_threads(max(2, threads))
        assert squared_norm(row, 0.5).item() == one
    finally:
        torch.set_num_threads(threads)


def test_rows_the_kernel_does_not_take_go_through_torch() -> None:
    base = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    strided = base[::2]  # not contiguous
    assert math.isclose(squared_norm(strided).item(), whole(strided, 1.0), rel_tol=1e-12)
    doubles = base.double()
    assert math.isclose(squared_norm(doubles).item(), whole(doubles, 1.0), rel_tol=1e-12)


@pytest.mark.parametrize("norm", [squared_norm, squared_norm_in_pieces])
def test_a_non_finite_gradient_makes_the_norm_non_finite(norm) -> None:
    row = torch.zeros(NORM_PIECE + 7, dtype=torch.bfloat16)
    row[-1] = float("inf")
    assert math.isinf(norm(row).item())
    row[-1] = float("nan")
    assert math.isnan(norm(row).item())
    assert norm(row[:0]).item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_accelerator_path_gives_the_rows_norm_in_fp32(dtype: torch.dtype) -> None:
    # runs on the host here: the same torch._foreach_norm call the engine makes on an accelerator's rows
    row = torch.randn(300_001, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = row_norm.device_squared_norm(row, 0.5)
    assert row_norm._FOREACH_DTYPE  # the fast call ran, not the fallback
    assert got.dtype == torch.float64 and got.dim() == 0
    assert math.isclose(got.item(), whole(row, 0.5), rel_tol=1e-4)  # fp32 accumulation, as clip_grad_norm_
    inf = torch.zeros(10, dtype=dtype)
    inf[3] = float("inf")
    assert math.isinf(row_norm.device_squared_norm(inf).item())
    assert row_norm.device_squared_norm(inf[:0]).item() == 0.0


def test_a_torch_whose_foreach_norm_takes_no_dtype_gets_the_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dtype(tensors, ord=2):  # noqa: A002 - torch's name
        raise TypeError("_foreach_norm() got an unexpected keyword argument 'dtype'")
    monkeypatch.setattr(torch, "_foreach_norm", no_dtype)
    monkeypatch.setattr(row_norm, "_FOREACH_DTYPE", True)
    row = torch.randn(5000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert row_norm.device_squared_norm(row, 0.5).item() == squared_norm_in_pieces(row, 0.5).item()
    assert not row_norm._FOREACH_DTYPE  # asked once, then the pieces
