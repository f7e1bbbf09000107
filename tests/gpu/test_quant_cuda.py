"""The quantizers on CUDA (the Triton kernels, through ``zeropp.quant``'s dispatch) are bit-identical to the
specification run on the CPU: the same cases as tests/unit/test_quant_triton.py (which runs the kernels in
Triton's CPU interpreter), plus sizes that fill a GPU, and the hot path's promise not to synchronize."""

from __future__ import annotations

import pytest
import torch

from support.quant_cases import (
    BITS,
    DTYPES,
    SMALL_LAYOUTS,
    assert_same_result,
    assert_same_rows,
    build_rows,
    gen,
    same_bits,
    spec_outcome,
    stack_pieces,
    tie_rows,
)
import zeropp.quant as zq
from zeropp.quant import BlockLayout, NonFiniteInputError, QuantizedRows, dispatch, payload_bytes, triton_available
from zeropp.quant import blockwise as spec

DEVICE = torch.device("cuda", 0)
BIG_LAYOUTS = [
    # parameter-like segments of odd lengths: thousands of blocks, int4 bytes shared by blocks
    ("many_params", BlockLayout((1, *([2047] * 300), 0, 3, 2048 * 200 + 1), 2048)),
    ("aligned_4M", BlockLayout((2048 * 2048,), 2048)),
    ("blocks_past_one_chunk", BlockLayout((3, 70001, 65536), 65536)),
]
LAYOUTS = SMALL_LAYOUTS + BIG_LAYOUTS
LAYOUT_IDS = [name for name, _ in LAYOUTS]


def cuda(obj):
    """A tensor or QuantizedRows moved to the GPU."""
    if isinstance(obj, QuantizedRows):
        return QuantizedRows(obj.data.to(DEVICE), obj.scales.to(DEVICE))
    return obj.to(DEVICE)


def assert_same_outcome(name: str, *args, **kwargs) -> None:
    """``zeropp.quant.<name>`` on CUDA copies of the inputs gives the CPU spec's bits, or raises alike."""
    want = spec_outcome(name, *args, **kwargs)
    dev_args = [cuda(a) if isinstance(a, (torch.Tensor, QuantizedRows)) else a for a in args]
    try:
        got = getattr(zq, name)(*dev_args, **kwargs)
    except NonFiniteInputError as e:
        assert want == ("nonfinite", e.row, e.segment)
        return
    assert want[0] == "ok", f"{name}: the spec raised {want}, CUDA did not"
    assert_same_result(got, want[1])


def test_cuda_tensors_take_the_triton_path():
    assert triton_available()
    assert dispatch._triton_path() is not None


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_dequantize_bit_identical(case, dtype, bits):
    _, layout = case
    x = build_rows(layout, dtype, seed=10)
    assert_same_outcome("quantize", x, layout, bits)
    q = spec.quantize(x, layout, bits)
    for out_dtype in DTYPES:
        assert_same_outcome("dequantize", q, layout, bits, out_dtype)


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bits", BITS)
def test_qgz_steps_bit_identical(case, bits):
    _, layout = case
    q = stack_pieces(layout, bits, 4, seed=50)  # pieces 4 x rows 3; rows 2 overflow when summed
    assert_same_outcome("dequantize_sum", q, layout, bits, 4)
    assert_same_outcome("dequantize_sum", q, layout, bits, 2, divisor=6)
    assert_same_outcome("dequantize_sum", q, layout, bits, 12, divisor=7.3)
    for poison in (False, True):
        assert_same_outcome("dequantize_sum_quantize", q, layout, bits, 4, poison=poison)
        assert_same_outcome("dequantize_sum_quantize", q, layout, bits, 2, poison=poison)


@pytest.mark.parametrize("bits", BITS)
def test_rounding_ties_bit_identical(bits):
    x, layout = tie_rows()
    assert_same_outcome("quantize", x, layout, bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_full_range(dtype, seed):
    g = gen(100 + seed)
    segs = torch.randint(0, 5000, (9,), generator=g)
    segs[torch.rand(9, generator=g) < 0.25] = 0
    layout = BlockLayout(tuple(segs.tolist()) + (1,), [2, 6, 256, 4096][seed])
    finfo = torch.finfo(dtype)
    lo, hi = torch.log2(torch.tensor(finfo.tiny)) - 8, torch.log2(torch.tensor(finfo.max))
    exps = lo + (hi - lo) * torch.rand(3, layout.numel, generator=g, dtype=torch.float64)
    signs = torch.randint(0, 2, (3, layout.numel), generator=g) * 2 - 1
    x = (signs * torch.exp2(exps)).to(dtype)
    x[torch.rand(3, layout.numel, generator=g) < 0.1] = 0
    for bits in BITS:
        assert_same_outcome("quantize", x, layout, bits)
        assert_same_outcome("dequantize", spec.quantize(x, layout, bits), layout, bits, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_non_finite_raises_or_poisons(dtype, bits):
    layout = BlockLayout((10, 0, 20, 30, 4097), 8)
    x = torch.randn(3, layout.numel, generator=gen(7)).to(dtype)
    x[2, 10 + 20 + 17] = float("nan")  # row 2, segment 3
    x[2, 100] = float("inf")
    x[1, 12] = float("-inf")  # first in row-major order: row 1, segment 2
    with pytest.raises(NonFiniteInputError) as info:
        zq.quantize(cuda(x), layout, bits)
    assert (info.value.row, info.value.segment) == (1, 2)
    assert_same_outcome("quantize", x, layout, bits, poison=True)


def test_out_arguments_are_written_and_returned():
    layout = BlockLayout((9, 0, 33, 1000), 16)
    x = torch.randn(4, layout.numel, generator=gen(11)).to(torch.bfloat16)
    for bits in BITS:
        ref = spec.quantize(x, layout, bits)
        buf = QuantizedRows(torch.empty(4, payload_bytes(layout, bits), dtype=torch.uint8, device=DEVICE),
                            torch.empty(4, layout.num_blocks, device=DEVICE))
        assert zq.quantize(cuda(x), layout, bits, out=buf) is buf
        assert_same_rows(buf, ref)
        flat = torch.empty(4 * layout.numel, dtype=torch.bfloat16, device=DEVICE)
        assert zq.dequantize(cuda(ref), layout, bits, torch.bfloat16, out=flat) is flat
        assert same_bits(flat.view(4, -1), spec.dequantize(ref, layout, bits, torch.bfloat16))
        total = torch.empty(2, layout.numel, device=DEVICE)
        assert zq.dequantize_sum(cuda(ref), layout, bits, 2, out=total, divisor=4) is total
        assert same_bits(total, spec.dequantize_sum(ref, layout, bits, 2, divisor=4))
        half = QuantizedRows(buf.data[:2], buf.scales[:2])
        assert zq.dequantize_sum_quantize(cuda(ref), layout, bits, 2, out=half) is half
        assert_same_rows(half, spec.dequantize_sum_quantize(ref, layout, bits, 2))


def test_hot_path_calls_do_not_synchronize():
    """poison=True quantize, dequantize and both qgZ steps launch kernels only: no device-to-host wait."""
    layout = BlockLayout((5, 4097, 2048 * 8), 2048)
    x = torch.randn(4, layout.numel, device=DEVICE)
    x[1, 7] = float("nan")
    q = zq.quantize(x, layout, 4, poison=True)  # first calls build and cache the layout's index tensors
    zq.dequantize_sum_quantize(q, layout, 4, 2, poison=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = zq.quantize(x, layout, 4, poison=True)
        zq.dequantize(q, layout, 4, torch.bfloat16)
        zq.dequantize_sum(q, layout, 4, 2, divisor=4)
        zq.dequantize_sum_quantize(q, layout, 4, 2, poison=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(q.scales[1].isnan().any())


def test_switch_sends_cuda_tensors_to_the_spec(monkeypatch):
    """ZEROPP_QUANT_TRITON=0: the Triton path is not called, and the results stay exact."""
    class Forbidden:
        def __getattr__(self, name):
            raise AssertionError(f"triton_path.{name} called with ZEROPP_QUANT_TRITON=0")

    layout = BlockLayout((100, 3), 16)
    x = torch.randn(2, layout.numel, generator=gen(12))
    monkeypatch.setenv("ZEROPP_QUANT_TRITON", "0")
    monkeypatch.setattr(dispatch, "_triton", Forbidden())
    monkeypatch.setattr(dispatch, "_tried", True)
    assert not triton_available()
    assert_same_rows(zq.quantize(cuda(x), layout, 8), spec.quantize(x, layout, 8))


@pytest.mark.parametrize("bits", BITS)
def test_rows_apart_are_read_and_written_in_place(bits):
    """The data part of a wire buffer (rows that end with scale bytes) is written and read in place."""
    layout = BlockLayout((7, 0, 33, 5000), 2048)
    pb, nb = payload_bytes(layout, bits), layout.num_blocks
    x = torch.randn(4, layout.numel, generator=gen(18))
    want = spec.quantize(x, layout, bits)
    wire = torch.full((4, pb + 4 * nb), 0xAB, dtype=torch.uint8, device=DEVICE)
    zq.quantize(cuda(x), layout, bits, out=QuantizedRows(wire[:, :pb], torch.empty(4, nb, device=DEVICE)))
    assert same_bits(wire[:, :pb], want.data) and bool((wire[:, pb:] == 0xAB).all())
    q = QuantizedRows(wire[:, :pb], cuda(want.scales))
    assert same_bits(zq.dequantize_sum(q, layout, bits, 2, divisor=4), spec.dequantize_sum(want, layout, bits, 2,
                                                                                            divisor=4))
    wire2 = torch.full((2, pb + 4 * nb), 0xCD, dtype=torch.uint8, device=DEVICE)
    out2 = QuantizedRows(wire2[:, :pb], torch.empty(2, nb, device=DEVICE))
    zq.dequantize_sum_quantize(q, layout, bits, 2, out=out2)
    assert_same_rows(out2, spec.dequantize_sum_quantize(want, layout, bits, 2))
    assert bool((wire2[:, pb:] == 0xCD).all())
