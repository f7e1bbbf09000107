"""Inputs and bit-exact comparisons shared by the quantizer kernel tests (the Triton kernels under the CPU
interpreter in tests/unit/test_quant_triton.py, and on CUDA in tests/gpu/test_quant_cuda.py)."""

from __future__ import annotations

import torch

from zeropp.quant import BlockLayout, QuantizedRows
from zeropp.quant import blockwise as spec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = (8, 4)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (name, layout): odd sizes, block_size -/+ 1, several odd segments (blocks starting on odd elements, so int4
# bytes shared by two blocks), aligned, and blocks longer than one kernel chunk (4096 elements).
SMALL_LAYOUTS = [
    ("numel1", BlockLayout((1,), 8)),
    ("numel3", BlockLayout((3,), 2)),
    ("bs_pm1", BlockLayout((7, 9, 8), 8)),
    ("odd_segments", BlockLayout((1, 3, 0, 9, 5, 16, 2), 8)),
    ("aligned", BlockLayout((16, 32), 16)),
    ("long_blocks", BlockLayout((3, 8193), 8192)),
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, device-independent bit patterns (-0 differs from +0); NaNs in the same places, any
    payload (a GPU writes its own canonical NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    zero = torch.zeros((), dtype=_INT_VIEW[a.dtype])
    return torch.equal(torch.where(nan, zero, a.view(_INT_VIEW[a.dtype])),
                       torch.where(nan, zero, b.view(_INT_VIEW[b.dtype])))


def assert_same_rows(got: QuantizedRows, want: QuantizedRows) -> None:
    assert same_bits(got.data, want.data), "data differs"
    assert same_bits(got.scales, want.scales), "scales differ"


def build_rows(layout: BlockLayout, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Three rows: (0) values spread over 6 decades; (1) a zero first block and one huge value (an outlier)
    per other block among small ones; (2) subnormals of ``dtype``, one normal value per block after the first
    (so the first block is purely subnormal), and the largest finite value in the last block."""
    n = layout.numel
    finfo = torch.finfo(dtype)
    x = torch.empty(3, n, dtype=torch.float64)
    x[0] = torch.randn(n, generator=gen(seed), dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)
    x[1] = torch.randn(n, generator=gen(seed + 1), dtype=torch.float64) * 1e-2
    starts = layout.block_starts()
    x[1, starts[1:-1]] = 3e4  # below fp16's max
    if layout.num_blocks:
        x[1, : int(starts[1])] = 0.0
    sub = torch.rand(n, generator=gen(seed + 2), dtype=torch.float64) * finfo.tiny
    x[2] = torch.where(torch.rand(n, generator=gen(seed + 3)) < 0.5, -sub, sub)
    if layout.num_blocks > 1:
        x[2, starts[1:-1]] = torch.linspace(1e-3, 1.0, layout.num_blocks - 1, dtype=torch.float64)
        x[2, int(starts[-2])] = finfo.max
    return x.to(dtype)


def stack_pieces(layout: BlockLayout, bits: int, pieces: int, seed: int) -> QuantizedRows:
    """``pieces`` quantized copies of ``build_rows`` (3 rows each, piece p scaled by 1 / (p + 1)), stacked
    [pieces, 3, ...]: rows 2 hold values near the largest float, so their sums overflow."""
    qs = [spec.quantize(build_rows(layout, torch.float32, seed + p) / (p + 1), layout, bits) for p in range(pieces)]
    return QuantizedRows(torch.cat([q.data for q in qs]), torch.cat([q.scales for q in qs]))


def tie_rows() -> tuple[torch.Tensor, BlockLayout]:
    """Rows whose x / scale fall exactly on, and one ulp either side of, every half-integer in [-qmax, qmax]
    for int8 (a superset of int4's): one block a row, so the scale is the row's first value / qmax."""
    rows = []
    for absmax in (1.0, 0.7, 3.3e-3, 123.4):
        for qmax in (127, 7):
            scale = torch.tensor(absmax, dtype=torch.float32) / qmax
            mid = (torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5) * scale
            vals = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
            rows.append(torch.cat([torch.tensor([absmax]), vals]))
    width = max(len(r) for r in rows)
    x = torch.stack([torch.cat([r, torch.zeros(width - len(r))]) for r in rows])
    return x, BlockLayout((width,), width + width % 2)


def spec_outcome(name: str, *args, **kwargs) -> tuple:
    """``("ok", result)`` or ``("nonfinite", row, segment)`` for the spec function ``name``."""
    try:
        return ("ok", getattr(spec, name)(*args, **kwargs))
    except spec.NonFiniteInputError as e:
        return ("nonfinite", e.row, e.segment)


def assert_same_result(got, want) -> None:
    """A kernel's result equals the spec's (QuantizedRows or a tensor) bit for bit."""
    if isinstance(want, QuantizedRows):
        assert_same_rows(got, want)
    else:
        assert same_bits(got, want)
