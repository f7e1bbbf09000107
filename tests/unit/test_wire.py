"""Wire format of quantized rows (data then fp32 scale bytes, one uint8 row per destination) and the
non-finite poisoning of Note [non-finite poisoning] in plus/wire.py."""
from __future__ import annotations

import pytest
import torch

from zeropp.plus.wire import WireFormat, decode_rows, encode_rows, first_poisoned, pack, quantize_poisoning, unpack
from zeropp.quant import BlockLayout, NonFiniteInputError, QuantizedRows, dequantize, payload_bytes, quantize

# segments chosen to give odd payloads (int8 odd numel, int4 odd ceil(numel/2)) and short last blocks
LAYOUTS = [
    BlockLayout((5,), 4),
    BlockLayout((3, 4, 7), 4),
    BlockLayout((2, 2), 2),
    BlockLayout((1,), 2),
    BlockLayout((9, 0, 6), 8),
    BlockLayout((64, 33), 32),
]


def _x(g: int, layout: BlockLayout, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(g, layout.numel, generator=gen) * 3).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equality of the raw bytes (NaN scales compare equal to themselves)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [2, 3])
def test_pack_unpack_round_trip(layout: BlockLayout, bits: int, g: int) -> None:
    q = quantize(_x(g, layout), layout, bits)
    payload = payload_bytes(layout, bits)
    wire = pack(q)
    assert wire.dtype == torch.uint8
    assert wire.shape == (g, payload + 4 * layout.num_blocks)
    assert torch.equal(wire[:, :payload], q.data)
    back = unpack(wire, payload)
    assert isinstance(back, QuantizedRows)
    assert _bits_equal(back.data, q.data)
    assert _bits_equal(back.scales, q.scales)
    assert back.scales.shape == (g, layout.num_blocks)


def test_unpack_survives_a_transfer() -> None:
    """Rows are independent: unpacking rows taken from a bigger gathered buffer gives each row's scales."""
    layout = BlockLayout((3, 4, 7), 4)
    q = quantize(_x(4, layout, seed=1), layout, 4)
    wire = pack(q)
    gathered = torch.cat([wire[2:], wire[:2]])  # as if received in another order
    back = unpack(gathered, payload_bytes(layout, 4))
    assert _bits_equal(back.scales, torch.cat([q.scales[2:], q.scales[:2]]))


def _single_row_cases() -> list:
    """Payloads of every alignment: a single row's scales start at byte offset ``payload`` (a regression:
    viewing them as float32 once failed unless the payload was a multiple of 4, crashing qwZ on one rank)."""
    return [pytest.param(layout, bits, id=f"{layout.segments}-{layout.block_size}-int{bits}")
            for layout in LAYOUTS for bits in (8, 4)]


@pytest.mark.parametrize("layout,bits", _single_row_cases())
def test_pack_unpack_single_row(layout: BlockLayout, bits: int) -> None:
    """One row (a world of one, or a group of one): unpack must not depend on the payload's alignment."""
    payload = payload_bytes(layout, bits)
    q = quantize(_x(1, layout, seed=2), layout, bits)
    back = unpack(pack(q), payload)
    assert _bits_equal(back.data, q.data) and _bits_equal(back.scales, q.scales)


def test_unpack_one_row_unaligned() -> None:
    layout = BlockLayout((5,), 4)  # int8 payload 5 B
    q = quantize(_x(1, layout, seed=3), layout, 8)
    back = unpack(pack(q), 5)
    assert _bits_equal(back.scales, q.scales)


# ---------------------------------------------------------------------------------------------- poisoning
def _block_of(layout: BlockLayout) -> torch.Tensor:
    starts = layout.block_starts()
    return torch.repeat_interleave(torch.arange(layout.num_blocks), starts[1:] - starts[:-1])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_input_is_plain_quantize(bits: int, dtype: torch.dtype) -> None:
    layout = BlockLayout((3, 4, 7), 4)
    x = _x(3, layout, seed=4, dtype=dtype)
    a, b = quantize_poisoning(x, layout, bits), quantize(x, layout, bits)
    assert _bits_equal(a.data, b.data) and _bits_equal(a.scales, b.scales)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poisoning_marks_exactly_the_bad_blocks(bits: int, dtype: torch.dtype) -> None:
    layout = BlockLayout((3, 4, 7, 6), 4)  # blocks: [0,3) [3,7) [7,11) [11,14) [14,18) [18,20)
    assert layout.num_blocks == 6
    x = _x(3, layout, seed=5, dtype=dtype)
    bad_positions = [(0, 4, float("inf")), (0, 5, float("nan")), (1, 19, float("-inf")), (2, 0, float("nan"))]
    for row, col, v in bad_positions:
        x[row, col] = v
    with pytest.raises(NonFiniteInputError):
        quantize(x, layout, bits)  # plain quantize refuses
    q = quantize_poisoning(x, layout, bits)
    block_of = _block_of(layout)
    expected_bad = torch.zeros(3, layout.num_blocks, dtype=torch.bool)
    for row, col, _ in bad_positions:
        expected_bad[row, block_of[col]] = True
    assert torch.equal(torch.isnan(q.scales), expected_bad)
    assert not torch.isinf(q.scales).any()

    # the other blocks are identical to plain quantize of the same values (bad blocks made finite)
    clean = x.clone()
    clean[~torch.isfinite(clean)] = 1.0
    ref = quantize(clean, layout, bits)
    good = ~expected_bad
    assert torch.equal(q.scales[good], ref.scales[good])
    deq = dequantize(QuantizedRows(q.data, torch.where(expected_bad, torch.zeros(()), q.scales)), layout, bits,
                     torch.float32)
    deq_ref = dequantize(ref, layout, bits, torch.float32)
    good_elem = good[:, block_of]
    assert torch.equal(deq[good_elem], deq_ref[good_elem])
    if bits == 8:  # one byte per element: the data bytes of good blocks match directly
        assert torch.equal(q.data[good_elem], ref.data[good_elem])
    # NaN scales dequantize to NaN over the whole bad block: the damage is visible on arrival
    assert torch.isnan(dequantize(q, layout, bits, torch.float32)[~good_elem]).all()


def test_poisoning_one_dimensional_input() -> None:
    layout = BlockLayout((4, 4), 4)
    x = torch.tensor([1.0, 2, 3, 4, 5, float("nan"), 7, 8])
    q = quantize_poisoning(x, layout, 8)
    assert q.scales.shape == (1, 2)
    assert not torch.isnan(q.scales[0, 0]) and torch.isnan(q.scales[0, 1])
    assert torch.equal(q.scales[0, 0], torch.tensor(4.0 / 127))


def test_poisoned_rows_survive_the_wire() -> None:
    layout = BlockLayout((3, 4), 4)
    x = _x(2, layout, seed=6)
    x[1, 2] = float("inf")
    q = quantize_poisoning(x, layout, 4)
    back = unpack(pack(q), payload_bytes(layout, 4))
    assert _bits_equal(back.scales, q.scales)
    assert first_poisoned(back.scales, layout) == (1, 0)


# ---------------------------------------------------------------------------------------------- first_poisoned
def test_first_poisoned_none_when_finite() -> None:
    layout = BlockLayout((3, 4), 2)
    assert first_poisoned(torch.ones(3, layout.num_blocks), layout) is None
    assert first_poisoned(torch.zeros(3, layout.num_blocks), layout) is None  # zero scales are fine


def test_first_poisoned_row_and_segment() -> None:
    layout = BlockLayout((3, 4, 5), 2)  # blocks per segment 2, 2, 3 -> segments of blocks [0,0,1,1,2,2,2]
    assert layout.num_blocks == 7
    s = torch.ones(3, 7)
    s[2, 1] = float("nan")
    assert first_poisoned(s, layout) == (2, 0)
    s[1, 6] = float("inf")
    assert first_poisoned(s, layout) == (1, 2)  # row-major: row 1 comes before row 2
    s[1, 3] = float("-inf")
    assert first_poisoned(s, layout) == (1, 1)
    s[0, 4] = float("nan")
    assert first_poisoned(s, layout) == (0, 2)


def test_first_poisoned_skips_empty_segments() -> None:
    layout = BlockLayout((2, 0, 2), 2)  # blocks belong to segments 0 and 2
    s = torch.ones(1, 2)
    s[0, 1] = float("nan")
    assert first_poisoned(s, layout) == (0, 2)


# ---------------------------------------------------------------------------------------------- hot path
def _garbage(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer's leftovers: whatever the previous user wrote (here: random bytes)."""
    t = torch.empty(*shape, dtype=dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return t


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_rows_writes_the_bytes_of_pack(layout: BlockLayout, bits: int, dtype: torch.dtype) -> None:
    """Quantizing straight into a reused packed buffer gives pack(quantize(...))'s bytes, any alignment, from
    rows that are views of another tensor (qgZ encodes bucket rows in reordered order)."""
    fmt = WireFormat(layout, bits)
    x = _x(4, layout, seed=7, dtype=dtype)
    order = [2, 0, 3, 1]
    wire = _garbage(4, fmt.row_bytes, dtype=torch.uint8)
    encode_rows(fmt, [x[i] for i in order], wire, _garbage(4, layout.num_blocks, dtype=torch.float32))
    assert fmt.payload == payload_bytes(layout, bits) and fmt.row_bytes == fmt.payload + 4 * layout.num_blocks
    assert torch.equal(wire, pack(quantize(x[order], layout, bits)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equals_dequantize_of_unpack(layout: BlockLayout, bits: int, dtype: torch.dtype) -> None:
    fmt = WireFormat(layout, bits)
    wire = pack(quantize(_x(3, layout, seed=8), layout, bits))
    out = _garbage(3, layout.numel, dtype=dtype)
    scales = _garbage(3, layout.num_blocks, dtype=torch.float32)
    decode_rows(fmt, wire, dtype, out, scales)
    q = unpack(wire, fmt.payload)
    assert _bits_equal(out, dequantize(q, layout, bits, dtype))
    assert _bits_equal(scales, q.scales)


@pytest.mark.parametrize("bits", [8, 4])
def test_encode_rows_poisons_into_the_buffer(bits: int) -> None:
    """Note [non-finite poisoning] holds on the hot path: a NaN-scaled block in the packed row, the same
    bytes as the allocating path, and the receiver finds the row and segment."""
    layout = BlockLayout((3, 4, 7), 4)
    fmt = WireFormat(layout, bits)
    x = _x(2, layout, seed=9)
    x[1, 5] = float("nan")
    wire = _garbage(2, fmt.row_bytes, dtype=torch.uint8)
    encode_rows(fmt, [x[0], x[1]], wire, _garbage(2, layout.num_blocks, dtype=torch.float32))
    assert torch.equal(wire, pack(quantize_poisoning(x, layout, bits)))
    out, scales = torch.empty(2, layout.numel), torch.empty(2, layout.num_blocks)
    decode_rows(fmt, wire, torch.float32, out, scales)
    assert first_poisoned(scales, layout) == (1, 1)
    assert torch.isnan(out[1, 3:7]).all() and not torch.isnan(out[0]).any()


def test_quantize_poisoning_into_out_is_the_allocating_result() -> None:
    layout = BlockLayout((5, 6), 4)
    x = _x(2, layout, seed=10)
    x[0, 0] = float("inf")
    want = quantize_poisoning(x, layout, 8)
    out = QuantizedRows(_garbage(2, payload_bytes(layout, 8), dtype=torch.uint8),
                        _garbage(2, layout.num_blocks, dtype=torch.float32))
    got = quantize_poisoning(x, layout, 8, out)
    assert got is out and _bits_equal(got.data, want.data) and _bits_equal(got.scales, want.scales)
