"""Block-wise quantizers: error bounds, format, edge cases, qgZ's reduction steps, and the C kernel's bit-identity
with the spec (the Triton kernels: test_quant_triton.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeropp import native
from zeropp.quant import (
    BlockLayout,
    NonFiniteInputError,
    QuantizedRows,
    dequantize,
    dequantize_sum,
    dequantize_sum_quantize,
    fast_available,
    payload_bytes,
    quantize,
    triton_available,
)
from zeropp.quant import blockwise as spec
from zeropp.quant import dispatch, fast

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = (8, 4, 2)
QMAX = {8: 127, 4: 7, 2: 1}
# Unit roundoff of the output dtype (half an ulp relative to |y|) and its smallest subnormal.
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
MIN_SUBNORMAL = {torch.float32: 0.0, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}

needs_fast = pytest.mark.skipif(not fast_available(), reason="fast kernel not built (no C compiler?)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _elem_block(layout: BlockLayout) -> torch.Tensor:
    starts = layout.block_starts()
    return torch.repeat_interleave(torch.arange(layout.num_blocks), starts[1:] - starts[:-1])


def error_bound(x: torch.Tensor, layout: BlockLayout, bits: int) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x| (float64), for output dtype = x.dtype.

    With s = fl(absmax / qmax) (relative error <= 2^-24) and q = round(fl(x / s)):
      |round(fl(x/s)) - x/s| <= 1/2 + |x/s| 2^-24 <= 1/2 + 128 * 2^-24      (|x/s| <= qmax (1 + 2^-24))
      |fl(q s) - q s|        <= |q s| 2^-24 <= 128 s 2^-24
    so the fp32 result y32 satisfies |y32 - x| <= s/2 (1 + 512 * 2^-24) <= absmax/(2 qmax) (1 + 2^-14) =: e.
    Clamping never hurts: it only changes q when |x/s| exceeds qmax, and then |x| <= absmax = qmax s (to
    rounding). The final cast to a 16-bit dtype rounds to nearest, adding at most half an ulp of |y32|:
    u |y32| <= u (|x| + e) with u = 2^-8 (bf16) or 2^-11 (fp16), plus half the smallest subnormal where y32
    falls in the subnormal range. Scales must be normal fp32 numbers (true for any input with absmax >= 2^-119).
    """
    xr = x.reshape(-1, layout.numel).double()
    absmax = torch.zeros(xr.shape[0], layout.num_blocks, dtype=torch.float64)
    if layout.numel:
        idx = _elem_block(layout).expand_as(xr)
        absmax.scatter_reduce_(1, idx, xr.abs(), reduce="amax")
        e = absmax.gather(1, idx) / (2 * QMAX[bits]) * (1 + 2.0**-14)
    else:
        e = torch.zeros_like(xr)
    u, sub = UNIT_ROUNDOFF[x.dtype], MIN_SUBNORMAL[x.dtype]
    return e + u * (xr.abs() + e) + sub / 2


def _skewed(g: int, layout: BlockLayout, seed: int) -> torch.Tensor:
    """Small values with one large outlier per block (the case block-wise scaling exists for)."""
    x = torch.randn(g, layout.numel, generator=_gen(seed)) * 1e-2
    x[:, layout.block_starts()[:-1]] = 50.0
    return x


# (name, rows G, layout, input builder) covering random, skewed, tiny, odd-sized and multi-segment inputs.
CASES = [
    ("random", 3, BlockLayout((1024,), 64), lambda g, lay: torch.randn(g, lay.numel, generator=_gen(1))),
    ("skewed", 2, BlockLayout((640,), 64), lambda g, lay: _skewed(g, lay, 2)),
    ("numel1", 2, BlockLayout((1,), 8), lambda g, lay: torch.randn(g, 1, generator=_gen(3))),
    ("numel3", 1, BlockLayout((3,), 2), lambda g, lay: torch.tensor([[0.5, -3.0, 1e-3]])),
    ("odd", 3, BlockLayout((1001,), 64), lambda g, lay: torch.randn(g, lay.numel, generator=_gen(4)) * 10),
    ("segments", 4, BlockLayout((3, 0, 130, 0, 64, 7, 1), 16),
     lambda g, lay: torch.randn(g, lay.numel, generator=_gen(5)) * torch.logspace(-2, 2, lay.numel)),
    ("segments_skewed", 2, BlockLayout((0, 33, 17, 0, 96), 32), lambda g, lay: _skewed(g, lay, 6)),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_bound(case, dtype, bits):
    _, g, layout, build = case
    x = build(g, layout).to(dtype)
    for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
        q = impl_q(x, layout, bits)
        assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (g, payload_bytes(layout, bits))
        assert q.scales.dtype == torch.float32 and tuple(q.scales.shape) == (g, layout.num_blocks)
        y = impl_dq(q, layout, bits, dtype)
        assert y.dtype == dtype and tuple(y.shape) == (g, layout.numel)
        err = (y.double() - x.double()).abs()
        bound = error_bound(x, layout, bits)
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_all_zero_round_trip_is_exact(dtype, bits):
    layout = BlockLayout((5, 0, 64, 3), 16)
    x = torch.zeros(2, layout.numel, dtype=dtype)
    x[1, :5] = -0.0
    x[1, 5:69] = torch.linspace(-1, 1, 64)  # a non-zero segment next to all-zero blocks
    for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
        q = impl_q(x, layout, bits)
        assert bool((q.scales[0] == 0).all()) and q.scales[1, 0] == 0 and q.scales[1, -1] == 0
        zero_byte = {8: 0, 4: 0x88, 2: 0xAA}[bits]  # int4 stores q + 8 = 8 per nibble, int2 q + 2 = 2 per crumb
        assert bool((q.data[0] == zero_byte).all())  # numel is a multiple of 4: no padding in this row
        y = impl_dq(q, layout, bits, dtype)
        assert not bool(y.isnan().any())
        assert torch.equal(y[0], x[0]) and torch.equal(y[1, :5], x[1, :5]) and torch.equal(y[1, 69:], x[1, 69:])


def test_int8_format_and_round_half_to_even():
    layout = BlockLayout((6,), 6)
    x = torch.tensor([127.0, -127.0, 2.5, -2.5, 3.5, 0.4])  # scale exactly 1
    for impl in (spec.quantize, quantize):
        q = impl(x, layout, 8)
        assert q.scales.tolist() == [[1.0]]
        assert q.data.tolist() == [[127, 129, 2, 254, 4, 0]]  # two's complement bytes; 2.5 -> 2, 3.5 -> 4


def test_int4_packing_order_and_padding():
    layout = BlockLayout((3,), 4)
    x = torch.tensor([7.0, -7.0, 0.0])  # scale 1 -> q = [7, -7, 0] -> nibbles [15, 1, 8]
    for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
        q = impl_q(x, layout, 4)
        assert q.data.tolist() == [[0x1F, 0x08]]  # first element in the low nibble; zero nibble pad
        assert impl_dq(q, layout, 4, torch.float32).tolist() == [[7.0, -7.0, 0.0]]
    # Across segments with odd lengths the nibble stream continues in row order (blocks do not realign bytes).
    layout = BlockLayout((1, 2), 2)
    q = spec.quantize(torch.tensor([7.0, -7.0, 7.0]), layout, 4)
    assert q.data.tolist() == [[0x1F, 0x0F]]


def test_int2_packing_order_and_padding():
    layout = BlockLayout((5,), 6)
    x = torch.tensor([1.0, -1.0, 0.0, 0.6, -0.4])  # scale 1 -> q = [1, -1, 0, 1, 0] -> crumbs [3, 1, 2, 3, 2]
    for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
        q = impl_q(x, layout, 2)
        assert q.scales.tolist() == [[1.0]]
        # element 4k + i in bits 2i, 2i + 1; the row's last byte holds one crumb and zero padding
        assert q.data.tolist() == [[3 | 1 << 2 | 2 << 4 | 3 << 6, 2]]
        assert impl_dq(q, layout, 2, torch.float32).tolist() == [[1.0, -1.0, 0.0, 1.0, 0.0]]


def test_one_bit_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no 1-bit code"):
        quantize(torch.ones(4), BlockLayout((4,), 4), 1)


def test_payload_bytes_and_layout():
    layout = BlockLayout((3, 0, 130, 0, 64, 7), 16)
    assert layout.numel == 204 and layout.num_blocks == 1 + 9 + 4 + 1
    assert layout.block_segment().tolist() == [0] + [2] * 9 + [4] * 4 + [5]
    assert layout.block_starts()[:3].tolist() == [0, 3, 19] and int(layout.block_starts()[-1]) == 204
    assert payload_bytes(layout, 8) == 204 and payload_bytes(layout, 4) == 102
    assert payload_bytes(BlockLayout((7,), 2), 4) == 4 and payload_bytes(BlockLayout((0, 0), 2), 4) == 0
    assert BlockLayout([4, 4], 4).aligned and not BlockLayout((4, 3), 4).aligned
    for bad in (((4,), 3), ((4,), 0), ((-1,), 4)):
        with pytest.raises(ValueError):
            BlockLayout(*bad)
    assert payload_bytes(layout, 2) == 51 and payload_bytes(BlockLayout((7,), 2), 2) == 2
    with pytest.raises(ValueError):
        payload_bytes(layout, 3)


def test_block_never_straddles_segments():
    """A 5-element segment of huge values next to tiny ones: the tiny ones keep their relative precision."""
    tiny = torch.linspace(1e-4, 1e-3, 123)
    x = torch.cat([torch.full((5,), 1e4), tiny])
    split = BlockLayout((5, 123), 64)
    merged = BlockLayout((128,), 64)  # what a bucket-wide blocking would do: first block mixes both
    for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
        y = impl_dq(impl_q(x, split, 8), split, 8, torch.float32)[0, 5:]
        assert bool(((y - tiny).abs() <= tiny.max() / 254 * 1.001).all())
        assert bool(((y - tiny).abs() / tiny <= 0.05).all())  # relative precision kept
        y_merged = impl_dq(impl_q(x, merged, 8), merged, 8, torch.float32)[0, 5:59]
        assert bool((y_merged == 0).all())  # all flushed to zero by the huge scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_non_finite_raises_with_row_and_segment(dtype, bits, bad):
    layout = BlockLayout((10, 0, 20, 30), 8)
    for impl in (spec.quantize, quantize):
        x = torch.randn(3, layout.numel, generator=_gen(7)).to(dtype)
        x[2, 10 + 20 + 17] = bad  # row 2, segment 3
        with pytest.raises(NonFiniteInputError) as info:
            impl(x, layout, bits)
        assert (info.value.row, info.value.segment) == (2, 3)
        assert "row 2" in str(info.value) and "segment 3" in str(info.value)
        x[1, 12] = bad  # an earlier one (row-major) is reported first: row 1, segment 2
        with pytest.raises(NonFiniteInputError) as info:
            impl(x, layout, bits)
        assert (info.value.row, info.value.segment) == (1, 2)
        assert isinstance(info.value, ValueError)


def test_one_dimensional_input_and_argument_checks():
    layout = BlockLayout((10,), 4)
    x = torch.randn(10, dtype=torch.bfloat16)
    q = quantize(x, layout, 8)
    assert q.data.shape == (1, 10) and dequantize(q, layout, 8, torch.bfloat16).shape == (1, 10)
    with pytest.raises(ValueError):
        quantize(x, layout, 3)
    with pytest.raises(ValueError):
        quantize(torch.randn(11), layout, 8)
    with pytest.raises(TypeError):
        quantize(torch.ones(10, dtype=torch.int32), layout, 8)
    with pytest.raises(ValueError):
        dequantize(QuantizedRows(q.data, q.scales[:, :1]), layout, 8, torch.float32)


def test_empty_layout():
    layout = BlockLayout((0, 0), 4)
    for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
        q = impl_q(torch.zeros(2, 0), layout, 4)
        assert q.data.shape == (2, 0) and q.scales.shape == (2, 0)
        assert impl_dq(q, layout, 4, torch.float16).shape == (2, 0)


# ---------------------------------------------------------------------------------------------------------
# Fast path: bit-identical to the spec (data and scales exactly equal, dequantized outputs torch.equal).


def _assert_identical(x: torch.Tensor, layout: BlockLayout, bits: int) -> None:
    a, b = fast.quantize(x, layout, bits), spec.quantize(x, layout, bits)
    assert torch.equal(a.data, b.data), "data differs"
    assert torch.equal(a.scales, b.scales), "scales differ"
    for dtype in DTYPES:
        ya, yb = fast.dequantize(a, layout, bits, dtype), spec.dequantize(b, layout, bits, dtype)
        assert ya.dtype == yb.dtype == dtype and torch.equal(ya, yb), f"dequantize to {dtype} differs"


@needs_fast
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bits", BITS)
def test_fast_bit_identical_cases(case, bits):
    _, g, layout, build = case
    x = build(g, layout)
    for dtype in DTYPES:
        _assert_identical(x.to(dtype), layout, bits)
    zeros = torch.zeros(g, layout.numel)
    _assert_identical(zeros, layout, bits)


@needs_fast
@pytest.mark.parametrize("seed", range(6))
def test_fast_bit_identical_random_layouts(seed):
    """Random segment lists (odd lengths, zero-length, tiny blocks) and values spanning the dtype's range,
    including subnormals and the largest finite values."""
    gen = _gen(100 + seed)
    nseg = int(torch.randint(1, 9, (1,), generator=gen))
    segs = torch.randint(0, 200, (nseg,), generator=gen)
    segs[torch.rand(nseg, generator=gen) < 0.25] = 0
    block_size = [2, 4, 6, 16, 64, 256][seed]
    layout = BlockLayout(tuple(segs.tolist()), block_size)
    g = int(torch.randint(1, 4, (1,), generator=gen))
    for dtype in DTYPES:
        finfo = torch.finfo(dtype)
        # log-uniform magnitudes from below the smallest normal to the largest finite value
        lo, hi = torch.log2(torch.tensor(finfo.tiny)) - 8, torch.log2(torch.tensor(finfo.max))
        exps = lo + (hi - lo) * torch.rand(g, layout.numel, generator=gen, dtype=torch.float64)
        signs = torch.randint(0, 2, (g, layout.numel), generator=gen) * 2 - 1
        x = (signs * torch.exp2(exps)).to(dtype)
        x[torch.rand(g, layout.numel, generator=gen) < 0.1] = 0
        x[:, :1] = finfo.max if layout.numel else x[:, :1]
        for bits in BITS:
            _assert_identical(x, layout, bits)


@needs_fast
@pytest.mark.parametrize("bits", BITS)
def test_fast_bit_identical_at_rounding_ties(bits):
    """x / scale exactly at, and one ulp either side of, every half-integer in [-qmax, qmax]."""
    qmax = QMAX[bits]
    rows = []
    for absmax in (1.0, 0.7, 3.3e-3, 123.4):
        scale = torch.tensor(absmax, dtype=torch.float32) / qmax
        mid = (torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5) * scale
        vals = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
        rows.append(torch.cat([torch.tensor([absmax]), vals]))
    x = torch.stack(rows)
    layout = BlockLayout((x.shape[1],), x.shape[1] + x.shape[1] % 2)  # one block a row: the scale is absmax/qmax
    _assert_identical(x, layout, bits)


# Long blocks for the kernel's AVX-512 body (128 elements a step), odd starts before and inside it, tails.
SIMD_LAYOUT = BlockLayout((1, 128, 255, 2048, 3, 4097, 130), 2048)


def _simd_edge_rows(bits: int, dtype: torch.dtype) -> torch.Tensor:
    """[4, numel] rows: random magnitudes; exact rounding ties (x / scale = j + 1/2, each block holding qmax as its
    largest |x|); subnormal blocks, where the clamp can act (fp32: max 15 * 2^-149 gives scale 2 * 2^-149 and a
    quotient of 7.5); and inf/nan (for the poisoning path)."""
    qmax, n = QMAX[bits], SIMD_LAYOUT.numel
    rand = torch.randn(n, generator=_gen(21)) * torch.logspace(-3, 3, n)
    ties = torch.cat([torch.tensor([float(qmax)]), torch.arange(-qmax, qmax) + 0.5]) * 2.0**-3
    tie_row = ties.repeat(-(-n // ties.numel()))[:n]
    tiny = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}[dtype]
    sub = torch.tensor([15.0, -14.0, 13.0, 7.0, -1.0, 0.0, 11.0]).repeat(-(-n // 7))[:n] * tiny
    bad = torch.randn(n, generator=_gen(22))
    bad[[300, 2500, n - 1]] = torch.tensor([float("inf"), float("nan"), float("-inf")])
    return torch.stack([rand, tie_row, sub.to(torch.float32), bad]).to(dtype)


def _check_simd_edges(bits: int) -> None:
    """The C kernel equals the spec on SIMD_LAYOUT: quantize (raising and poisoning), dequantize, and qgZ's fused
    steps, whose requantization runs the fp32 body."""
    layout = SIMD_LAYOUT
    for dtype in DTYPES:
        x = _simd_edge_rows(bits, dtype)
        _assert_identical(x[:3], layout, bits)
        assert _rows_equal(fast.quantize(x, layout, bits, poison=True), spec.quantize(x, layout, bits, poison=True))
    q = spec.quantize(_simd_edge_rows(bits, torch.float32)[:3].repeat(2, 1) * 0.37, layout, bits)
    for poison in (False, True):
        qq = q if poison else QuantizedRows(q.data[:4], q.scales[:4])  # rows 0-3: finite
        assert _rows_equal(fast.dequantize_sum_quantize(qq, layout, bits, 2, poison=poison),
                           spec.dequantize_sum_quantize(qq, layout, bits, 2, poison=poison)), poison
    for divisor in (4.0, 3.0):
        assert _same_bits(fast.dequantize_sum(q, layout, bits, 2, divisor=divisor),
                          spec.dequantize_sum(q, layout, bits, 2, divisor=divisor)), divisor


@needs_fast
@pytest.mark.parametrize("bits", (8, 4))
def test_fast_simd_body_bit_identical(bits):
    _check_simd_edges(bits)


@needs_fast
def test_fast_split_sums_fall_back_where_they_must():
    """Note [split sums]: qgZ's middle step on int4 blocks of whole 128-element groups at even starts (2048, 128
    and 256 here; the 1-element segment puts the last block at an odd start) equals the spec, including a block
    whose sum overflows, one with a NaN piece and one whose sums are subnormal, which it leaves to the general
    path."""
    layout = BlockLayout((2048, 128, 512, 1, 256), 256)
    x = torch.randn(6, layout.numel, generator=_gen(31)) * torch.logspace(-2, 2, layout.numel)
    x[1, 100] = x[4, 100] = 3e38  # rows 1 of both pieces: the sum overflows in block 0
    x[2, 2048:2176] *= 2.0**-140  # row 2: subnormal sums in the 128-element block
    x[5, 2048:2176] *= 2.0**-140
    q = spec.quantize(x, layout, 4)
    finite = QuantizedRows(q.data[[0, 2, 3, 5]], q.scales[[0, 2, 3, 5]].clone())  # rows 0 and 2 of both pieces
    q.scales[3, 9] = float("nan")  # piece 1, row 0: a poisoned block (the first 256 of the 512 segment)
    for impl in (spec.dequantize_sum_quantize, fast.dequantize_sum_quantize):
        with pytest.raises(NonFiniteInputError) as info:
            impl(q, layout, 4, 2)
        assert (info.value.row, info.value.segment) == (0, 2)
    want = spec.dequantize_sum_quantize(q, layout, 4, 2, poison=True)
    assert want.scales.isnan().nonzero().tolist() == [[0, 9], [1, 0]]
    assert _rows_equal(fast.dequantize_sum_quantize(q, layout, 4, 2, poison=True), want)
    assert _rows_equal(fast.dequantize_sum_quantize(finite, layout, 4, 2),
                       spec.dequantize_sum_quantize(finite, layout, 4, 2))


@pytest.mark.skipif(native.compiler() is None or os.environ.get("ZEROPP_QUANT_FAST") == "0",
                    reason="no C compiler, or the kernel turned off")
def test_fast_kernel_builds_and_passes_its_self_test():
    """Where a C compiler exists, the kernel must build and agree with the spec: a kernel that failed its
    self-test would only warn and fall back to the spec, and every ``needs_fast`` test would skip."""
    assert fast_available()


@needs_fast
def test_fast_simd_body_is_built_on_avx512_machines():
    """The AVX-512 body is in the loaded kernel exactly when the CPU has AVX-512F/BW, so the test above runs it
    on such machines (and a build that quietly dropped it would show here)."""
    flags = set(native.cpu_key().split(":", 1)[-1].split())  # the line the kernel's build is keyed by
    assert fast.simd_built() == ({"avx512f", "avx512bw"} <= flags)


@needs_fast
def test_fast_portable_build_bit_identical():
    """``ZEROPP_QUANT_SIMD=0`` builds the portable C only (what machines without AVX-512 run); it equals the spec
    on the same edges, clamp-free loops included (Note [clamp-free codes])."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from test_quant import _check_simd_edges, fast; "
            "_check_simd_edges(8); _check_simd_edges(4); print('simd', fast.simd_built())")
    env = {**os.environ, "ZEROPP_QUANT_SIMD": "0"}
    res = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("simd False"), res.stdout


@needs_fast
@pytest.mark.parametrize("bits", BITS)
def test_fast_multithreaded_odd_segments(bits):
    """Large enough to split over threads; odd segment lengths put int4 blocks on odd nibble offsets."""
    segs = (1, *([2047] * 150), 0, 3, 4096 * 80)
    layout = BlockLayout(segs, 4096)
    assert layout.numel > 2 * fast._MIN_ELEMS_PER_THREAD
    x = torch.randn(1, layout.numel, generator=_gen(9)).to(torch.bfloat16)
    _assert_identical(x, layout, bits)
    x2 = torch.randn(2, layout.numel // 2 + 1, generator=_gen(10))
    half = BlockLayout((7, layout.numel // 2 - 6), 64)
    _assert_identical(x2, half, bits)


@needs_fast
def test_fast_out_arguments():
    layout = BlockLayout((100, 0, 33), 16)
    x = torch.randn(3, layout.numel, generator=_gen(11), dtype=torch.float32).to(torch.bfloat16)
    for bits in BITS:
        ref = spec.quantize(x, layout, bits)
        for impl_q, impl_dq in ((spec.quantize, spec.dequantize), (quantize, dequantize)):
            buf = QuantizedRows(torch.empty_like(ref.data), torch.empty_like(ref.scales))
            got = impl_q(x, layout, bits, out=buf)
            assert got is buf and torch.equal(buf.data, ref.data) and torch.equal(buf.scales, ref.scales)
            flat = torch.empty(3 * layout.numel, dtype=torch.bfloat16)  # any shape with the right numel
            assert impl_dq(ref, layout, bits, torch.bfloat16, out=flat) is flat
            assert torch.equal(flat.view(3, -1), spec.dequantize(ref, layout, bits, torch.bfloat16))
            with pytest.raises(ValueError):
                impl_dq(ref, layout, bits, torch.float32, out=flat)


def test_dispatch_falls_back_to_spec_without_kernel(monkeypatch):
    monkeypatch.setattr(fast, "_lib", None)
    monkeypatch.setattr(fast, "_tried", True)
    assert not fast_available()
    layout = BlockLayout((5, 9), 4)
    x = torch.randn(2, 14, generator=_gen(12))
    q = quantize(x, layout, 4)
    ref = spec.quantize(x, layout, 4)
    assert torch.equal(q.data, ref.data) and torch.equal(q.scales, ref.scales)
    assert torch.equal(dequantize(q, layout, 4, torch.float16), spec.dequantize(ref, layout, 4, torch.float16))


# ---------------------------------------------------------------------------------------------------------
# qgZ's reduction steps and poisoning: the spec's definition, and the C kernel bit-identical to it.

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0 differs from +0); NaNs in the same places, any payload."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    zero = torch.zeros((), dtype=_INT_VIEW[a.dtype])
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        torch.where(nan, zero, a.view(_INT_VIEW[a.dtype])), torch.where(nan, zero, b.view(_INT_VIEW[b.dtype])))


def _rows_equal(a: QuantizedRows, b: QuantizedRows) -> bool:
    return torch.equal(a.data, b.data) and _same_bits(a.scales, b.scales)


def test_dequantize_sum_adds_pieces_left_to_right():
    """Pieces that dequantize exactly to 2^24, 1, -2^24: left to right, 2^24 + 1 rounds (to even) back to 2^24
    and the sum is 0; any other order gives 1."""
    layout = BlockLayout((2,), 2)
    codes = torch.tensor([[64, 0], [1, 0], [-64, 0]], dtype=torch.int8).view(torch.uint8)
    q = QuantizedRows(codes, torch.tensor([[2.0**18], [1.0], [2.0**18]]))
    for impl in (spec.dequantize_sum, fast.dequantize_sum):
        assert impl(q, layout, 8, 3).tolist() == [[0.0, 0.0]]
        assert impl(q, layout, 8, 1).tolist() == [[2.0**24, 0.0], [1.0, 0.0], [-(2.0**24), 0.0]]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_sum_divides_by_the_divisor_exactly(case, bits):
    """The divisor is a true fp32 division: the exact quotient of the fp32 sum, rounded once (computing it in
    float64 and rounding to float32 is exact for one division)."""
    _, g, layout, build = case
    q = spec.quantize(build(g, layout), layout, bits)
    total = spec.dequantize_sum(q, layout, bits, g)
    for divisor in (3, 7.3):
        d32 = float(torch.tensor(divisor, dtype=torch.float32))
        want = (total.double() / d32).float()
        for impl in (spec.dequantize_sum, dequantize_sum):
            assert _same_bits(impl(q, layout, bits, g, divisor=divisor), want)


@needs_fast
def test_fast_power_of_two_divisor_keeps_the_division_bits():
    """The C kernel multiplies by 2^-k for a divisor 2^k (one correct rounding of the same real number). The
    edges: quotients that fall into the subnormals (where a multiply by a rounded reciprocal would differ),
    inf and nan sums, divisors at and past the exponent range where the kernel divides instead."""
    layout = BlockLayout((6,), 6)
    codes = torch.tensor([[127, -127, 3, 1, 0, 127], [0, 0, 0, 1, 0, 127]], dtype=torch.int8).view(torch.uint8)
    scales = [1e-30, 3e-38, 1.5e-38, 1e-45, 1.0, 2.0**100, 3.0e38, float("inf"), float("nan")]
    for sa in scales:
        for sb in (1.0, 1e-40):
            q = QuantizedRows(codes, torch.tensor([[sa], [sb]]))
            for divisor in (2.0, 4.0, 2.0**-20, 2.0**20, 2.0**-125, 2.0**-126, 2.0**125, 2.0**126, 2.0**127):
                want = spec.dequantize_sum(q, layout, 8, 2, divisor=divisor)
                assert _same_bits(fast.dequantize_sum(q, layout, 8, 2, divisor=divisor), want), (sa, sb, divisor)


@needs_fast
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bits", BITS)
def test_fast_qgz_steps_bit_identical(case, bits):
    _, g, layout, build = case
    x = build(g, layout)
    stacked = torch.cat([x, x * -0.37, x * 3.1])  # 3 pieces of g rows
    q = spec.quantize(stacked, layout, bits)
    for pieces in (1, 3, 3 * g):
        for divisor in (None, 6):
            want = spec.dequantize_sum(q, layout, bits, pieces, divisor=divisor)
            assert _same_bits(fast.dequantize_sum(q, layout, bits, pieces, divisor=divisor), want), pieces
        for poison in (False, True):
            want = spec.dequantize_sum_quantize(q, layout, bits, pieces, poison=poison)
            assert _rows_equal(fast.dequantize_sum_quantize(q, layout, bits, pieces, poison=poison), want), pieces


@needs_fast
@pytest.mark.parametrize("bits", BITS)
def test_fast_qgz_steps_multithreaded_odd_segments(bits):
    segs = (3, *([2047] * 70), 0, 4096 * 40 + 1)
    layout = BlockLayout(segs, 4096)
    x = torch.randn(4, layout.numel, generator=_gen(13))
    q = spec.quantize(x, layout, bits)
    assert _same_bits(fast.dequantize_sum(q, layout, bits, 2, divisor=2),
                      spec.dequantize_sum(q, layout, bits, 2, divisor=2))
    want = spec.dequantize_sum_quantize(q, layout, bits, 4)
    assert _rows_equal(fast.dequantize_sum_quantize(q, layout, bits, 4), want)


@needs_fast
@pytest.mark.parametrize("bits", BITS)
def test_fast_qgz_steps_non_finite(bits):
    """An overflowing sum and a NaN scale that arrived: raise naming the output row and segment, or poison."""
    layout = BlockLayout((5, 12, 3), 4)
    x = torch.randn(6, layout.numel, generator=_gen(14))
    x[1, 6] = x[4, 6] = 3e38  # rows 1 of both pieces: the sum overflows in block 2 (segment 1)
    q = spec.quantize(x, layout, bits)
    q.scales[5, 5] = float("nan")  # piece 1, row 2, block 5 (segment 2)
    for impl in (spec.dequantize_sum_quantize, fast.dequantize_sum_quantize):
        with pytest.raises(NonFiniteInputError) as info:
            impl(q, layout, bits, 2)
        assert (info.value.row, info.value.segment) == (1, 1)
    want = spec.dequantize_sum_quantize(q, layout, bits, 2, poison=True)
    assert want.scales.isnan().nonzero().tolist() == [[1, 2], [2, 5]]
    assert _rows_equal(fast.dequantize_sum_quantize(q, layout, bits, 2, poison=True), want)
    assert _same_bits(fast.dequantize_sum(q, layout, bits, 2), spec.dequantize_sum(q, layout, bits, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_poison_marks_bad_blocks_and_quantizes_the_rest(dtype, bits):
    """poison=True: NaN scales exactly on the blocks holding inf/nan, codes as if those elements were 0; the
    C kernel gives the same bits (also over threads, with bad blocks on odd int4 offsets)."""
    layout = BlockLayout((10, 0, 21, 30), 8)
    x = torch.randn(3, layout.numel, generator=_gen(15)).to(dtype)
    x[0, 3], x[2, 33], x[2, 60] = float("nan"), float("inf"), float("-inf")
    q = spec.quantize(x, layout, bits, poison=True)
    assert q.scales.isnan().nonzero().tolist() == [[0, 0], [2, 5], [2, 8]]
    clean = spec.quantize(torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype)), layout, bits)
    assert torch.equal(q.data, clean.data)
    assert torch.equal(q.scales[~q.scales.isnan()], clean.scales[~q.scales.isnan()])
    if fast_available():
        assert _rows_equal(fast.quantize(x, layout, bits, poison=True), q)
    if fast_available() and dtype == torch.bfloat16:
        big = BlockLayout((3, *([2047] * 150), 4096 * 80), 4096)
        xb = torch.randn(1, big.numel, generator=_gen(16)).to(dtype)
        xb[0, ::100_000] = float("nan")
        assert _rows_equal(fast.quantize(xb, big, bits, poison=True), spec.quantize(xb, big, bits, poison=True))


def test_qgz_step_argument_errors():
    layout = BlockLayout((10,), 4)
    q = spec.quantize(torch.randn(4, 10, generator=_gen(17)), layout, 8)
    for impl in (spec.dequantize_sum, dequantize_sum):
        with pytest.raises(ValueError, match="pieces"):
            impl(q, layout, 8, 3)
        with pytest.raises(ValueError, match="divisor"):
            impl(q, layout, 8, 2, divisor=0)
        with pytest.raises(ValueError, match="out"):
            impl(q, layout, 8, 2, out=torch.empty(10))
    with pytest.raises(ValueError, match="quantize: out"):
        dequantize_sum_quantize(q, layout, 8, 2, out=QuantizedRows(torch.empty(1, 10, dtype=torch.uint8),
                                                                     torch.empty(1, 3)))


def test_import_leaves_triton_alone():
    """``import zeropp`` does not import triton (about half a second): dispatch imports it on a CUDA call."""
    code = "import sys, zeropp, zeropp.quant; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_switch_keeps_cuda_tensors_off_triton(monkeypatch):
    """ZEROPP_QUANT_TRITON=0: even with a CUDA device, the Triton path is neither imported nor used."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "_tried", False)
    monkeypatch.setattr(dispatch, "_triton", None)
    monkeypatch.setenv("ZEROPP_QUANT_TRITON", "0")
    assert not triton_available()
    assert not dispatch._tried  # not even looked for


@pytest.mark.parametrize("bits", BITS)
def test_rows_apart_are_read_and_written_in_place(bits):
    """Data rows that are each contiguous but sit apart (the data part of a wire buffer whose rows end with
    scale bytes) are quantized into and read from in place, by every implementation, with the spec's bits."""
    layout = BlockLayout((7, 0, 33, 5), 8)
    pb, nb = payload_bytes(layout, bits), layout.num_blocks
    x = torch.randn(4, layout.numel, generator=_gen(18)).to(torch.bfloat16)
    want = spec.quantize(x, layout, bits)
    for impl in (spec, fast):
        wire = torch.full((4, pb + 4 * nb), 0xAB, dtype=torch.uint8)
        out = QuantizedRows(wire[:, :pb], torch.empty(4, nb))
        assert impl.quantize(x, layout, bits, out=out) is out
        assert torch.equal(wire[:, :pb], want.data) and bool((wire[:, pb:] == 0xAB).all())
        q = QuantizedRows(wire[:, :pb], want.scales)
        assert torch.equal(impl.dequantize(q, layout, bits, torch.float32), spec.dequantize(want, layout, bits,
                                                                                             torch.float32))
        assert _same_bits(impl.dequantize_sum(q, layout, bits, 2, divisor=4),
                          spec.dequantize_sum(want, layout, bits, 2, divisor=4))
        wire2 = torch.full((2, pb + 4 * nb), 0xCD, dtype=torch.uint8)
        out2 = QuantizedRows(wire2[:, :pb], torch.empty(2, nb))
        impl.dequantize_sum_quantize(q, layout, bits, 2, out=out2)
        assert _rows_equal(QuantizedRows(wire2[:, :pb].clone(), out2.scales),
                           spec.dequantize_sum_quantize(want, layout, bits, 2))
        assert bool((wire2[:, pb:] == 0xCD).all())
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize(x, layout, bits, out=QuantizedRows(torch.empty(pb, 4, dtype=torch.uint8).t(), torch.empty(4, nb)))
