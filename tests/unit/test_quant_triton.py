"""The Triton quantizer kernels, run by Triton's CPU interpreter, are bit-identical to the spec (blockwise.py).

TRITON_INTERPRET=1 must be set before triton is first imported, and must not leak into the rest of the suite
(another test may have imported triton already, and a test after this one must not find interpreted kernels).
So the kernels run in one worker subprocess, started with that variable: this file, run as a script with
``--triton-interpreter-worker``. Each test sends it inputs and compares what comes back with the spec computed
here. The interpreter executes every program in Python, so the sizes are small (the file runs in about a
minute on two cores); tests/gpu/test_quant_cuda.py runs the same checks on CUDA with larger sizes.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys

import pytest
import torch

if __name__ == "__main__":  # the worker: tests/ on the path for support/ (conftest.py does it under pytest)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
from support.matrix import Matrix
from zeropp.quant import BlockLayout, QuantizedRows, payload_bytes
from zeropp.quant import blockwise as spec

if importlib.util.find_spec("triton") is None:  # not imported here: this process stays free of triton
    pytest.skip("triton is a dev dependency (pyproject.toml): pip install -e '.[dev]'", allow_module_level=True)

WORKER_FLAG = "--triton-interpreter-worker"
LAYOUT_IDS = [name for name, _ in SMALL_LAYOUTS]
# layouts x dtypes x bits: each value in make test, every combination under full_matrix
_NAMES = {"case": lambda c: c[0]}
QUANTIZE = Matrix(ids=_NAMES, case=SMALL_LAYOUTS, dtype=DTYPES, bits=BITS)
BY_BITS = Matrix(ids=_NAMES, case=SMALL_LAYOUTS, bits=BITS)


# --------------------------------------------------------------------------------------------------------
# The worker: this file as a script.


def _serve() -> None:
    """Answer (function name, args, kwargs) requests on stdin with pickled results on the original stdout."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed (warnings, the interpreter) goes to stderr, not into the replies
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from zeropp.quant import triton_kernels, triton_path

    requests = sys.stdin.buffer
    while True:
        try:
            name, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        if name == "info":
            kernels = [triton_kernels._quantize_kernel, triton_kernels._dequantize_kernel]
            answer = ("ok", {"interpret": bool(triton.knobs.runtime.interpret),
                             "interpreted": all(isinstance(k, InterpretedFunction) for k in kernels)}, False)
        else:
            try:
                result = getattr(triton_path, name)(*args, **kwargs)
                answer = ("ok", result, "out" in kwargs and result is kwargs["out"])
            except spec.NonFiniteInputError as e:
                answer = ("nonfinite", e.row, e.segment)
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails
                answer = ("error", type(e).__name__, str(e))
        pickle.dump(answer, reply)
        reply.flush()


class Worker:
    """A subprocess running the Triton kernels under the interpreter."""

    def __init__(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), WORKER_FLAG], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def raw(self, name: str, *args, **kwargs) -> tuple:
        pickle.dump((name, args, kwargs), self.proc.stdin)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)

    def __call__(self, name: str, *args, **kwargs):
        answer = self.raw(name, *args, **kwargs)
        assert answer[0] == "ok", f"{name} failed in the worker: {answer}"
        return answer[1]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def tk():
    worker = Worker()
    yield worker
    worker.close()


def test_worker_runs_the_kernels_in_the_interpreter(tk):
    info = tk("info")
    assert info == {"interpret": True, "interpreted": True}
    assert os.environ.get("TRITON_INTERPRET") != "1"  # not leaked into this process


# --------------------------------------------------------------------------------------------------------
# quantize / dequantize


@QUANTIZE.parametrize
def test_quantize_bit_identical(tk, case, dtype, bits):
    _, layout = case
    x = build_rows(layout, dtype, seed=10)
    assert_same_rows(tk("quantize", x, layout, bits), spec.quantize(x, layout, bits))


@BY_BITS.parametrize
def test_dequantize_bit_identical(tk, case, bits):
    _, layout = case
    q = spec.quantize(build_rows(layout, torch.float32, seed=20), layout, bits)
    for dtype in DTYPES:
        assert same_bits(tk("dequantize", q, layout, bits, dtype), spec.dequantize(q, layout, bits, dtype)), dtype


@pytest.mark.parametrize("bits", BITS)
def test_rounding_ties_bit_identical(tk, bits):
    x, layout = tie_rows()
    assert_same_rows(tk("quantize", x, layout, bits), spec.quantize(x, layout, bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_layouts_full_range(tk, dtype):
    """Random segment lists and log-uniform magnitudes from below the smallest normal to the largest finite."""
    g = gen(30 + DTYPES.index(dtype))
    segs = torch.randint(0, 30, (4,), generator=g)
    segs[torch.rand(4, generator=g) < 0.25] = 0
    layout = BlockLayout(tuple(segs.tolist()) + (1,), 10)
    finfo = torch.finfo(dtype)
    lo, hi = torch.log2(torch.tensor(finfo.tiny)) - 8, torch.log2(torch.tensor(finfo.max))
    exps = lo + (hi - lo) * torch.rand(2, layout.numel, generator=g, dtype=torch.float64)
    signs = torch.randint(0, 2, (2, layout.numel), generator=g) * 2 - 1
    x = (signs * torch.exp2(exps)).to(dtype)
    for bits in BITS:
        q = tk("quantize", x, layout, bits)
        assert_same_rows(q, spec.quantize(x, layout, bits))
        assert same_bits(tk("dequantize", q, layout, bits, dtype), spec.dequantize(q, layout, bits, dtype))


def test_one_dimensional_input_and_empty_layout(tk):
    layout = BlockLayout((5, 4), 4)
    x = torch.randn(9, generator=gen(40)).to(torch.bfloat16)
    assert_same_rows(tk("quantize", x, layout, 4), spec.quantize(x, layout, 4))
    empty = BlockLayout((0, 0), 4)
    q = tk("quantize", torch.zeros(2, 0), empty, 4)
    assert q.data.shape == (2, 0) and q.scales.shape == (2, 0)
    assert tk("dequantize", q, empty, 4, torch.float16).shape == (2, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_non_finite_raises_with_row_and_segment(tk, dtype, bits):
    layout = BlockLayout((10, 0, 20, 30), 16)
    bad = {torch.float32: float("inf"), torch.bfloat16: float("-inf"), torch.float16: float("nan")}[dtype]
    x = torch.randn(3, layout.numel, generator=gen(7)).to(dtype)
    x[2, 10 + 20 + 17] = bad  # row 2, segment 3
    assert tk.raw("quantize", x, layout, bits) == ("nonfinite", 2, 3)
    x[1, 12] = bad  # an earlier one (row-major) is reported first: row 1, segment 2
    assert tk.raw("quantize", x, layout, bits) == ("nonfinite", 1, 2)
    # poison: no exception; NaN scales on the bad blocks, the rest as the spec says
    assert_same_rows(tk("quantize", x, layout, bits, poison=True), spec.quantize(x, layout, bits, poison=True))


def test_poison_marks_blocks_on_int4_seams(tk):
    """Non-finite values on both sides of an int4 byte shared by two blocks (odd segment lengths)."""
    layout = BlockLayout((3, 5, 7, 2), 4)
    x = torch.randn(2, layout.numel, generator=gen(8))
    x[0, 2], x[0, 3], x[1, 8] = float("nan"), float("inf"), float("-inf")
    want = spec.quantize(x, layout, 4, poison=True)
    assert bool(want.scales.isnan().any())
    assert_same_rows(tk("quantize", x, layout, 4, poison=True), want)


# --------------------------------------------------------------------------------------------------------
# qgZ's steps: dequantize_sum, dequantize_sum_quantize


def assert_same_outcome(tk, name: str, *args, **kwargs) -> None:
    """The worker's ``name`` and the spec's give the same bits, or raise NonFiniteInputError alike."""
    want = spec_outcome(name, *args, **kwargs)
    got = tk.raw(name, *args, **kwargs)
    assert got[0] == want[0], f"{name}: worker {got}, spec {want[0]}"
    if want[0] == "nonfinite":
        assert got == want
    else:
        assert_same_result(got[1], want[1])


@BY_BITS.parametrize
def test_dequantize_sum_bit_identical(tk, case, bits):
    _, layout = case
    q = stack_pieces(layout, bits, 2, seed=50)  # 6 rows
    assert_same_outcome(tk, "dequantize_sum", q, layout, bits, 2)
    assert_same_outcome(tk, "dequantize_sum", q, layout, bits, 6, divisor=7.3)


@BY_BITS.parametrize
def test_dequantize_sum_quantize_bit_identical(tk, case, bits):
    """Row 2 of each piece holds values near the largest float: their sums overflow, which poisons those
    blocks in both implementations (the raising mode: test_fused_step_with_poisoned_pieces)."""
    _, layout = case
    q = stack_pieces(layout, bits, 2, seed=60)  # pieces 2 x rows 3
    assert_same_outcome(tk, "dequantize_sum_quantize", q, layout, bits, 2, poison=True)


def test_signed_zero_survives_a_zero_scale(tk):
    """Codes with a zero scale (not what quantize writes, but bytes can arrive) dequantize to -0 for negative
    codes; the sums must keep it (they start from -0.0, not from +0.0)."""
    layout = BlockLayout((6,), 6)
    data = torch.tensor([[129, 255, 0, 3, 200, 1]], dtype=torch.uint8)  # int8 codes -127, -1, 0, 3, -56, 1
    q = QuantizedRows(data, torch.zeros(1, 1))
    want = spec.dequantize(q, layout, 8, torch.float32)
    assert bool(torch.signbit(want[0, 0])) and float(want[0, 0]) == 0.0
    assert_same_outcome(tk, "dequantize", q, layout, 8, torch.float32)
    assert_same_outcome(tk, "dequantize_sum", q, layout, 8, 1)


@pytest.mark.parametrize("bits", BITS)
def test_fused_step_with_poisoned_pieces(tk, bits):
    """A NaN scale arriving in one piece poisons that block of the sum: raise naming it, or pass it on."""
    layout = BlockLayout((5, 12, 3), 8)  # blocks [0, 5) [5, 13) [13, 17) [17, 20): three start on odd elements
    x = torch.randn(6, layout.numel, generator=gen(70))
    x[5, 17] = 3e38
    x[2, 17] = 3e38  # rows 2 of both pieces: their sum overflows in block 3 (segment 2)
    q = spec.quantize(x, layout, bits)  # pieces 2 x rows 3
    q.scales[4, 1] = float("nan")  # piece 1, row 1, block 1 (segment 1)
    assert tk.raw("dequantize_sum_quantize", q, layout, bits, 2) == ("nonfinite", 1, 1)
    want = spec.dequantize_sum_quantize(q, layout, bits, 2, poison=True)
    assert want.scales.isnan().nonzero().tolist() == [[1, 1], [2, 3]]
    assert_same_rows(tk("dequantize_sum_quantize", q, layout, bits, 2, poison=True), want)
    assert same_bits(tk("dequantize_sum", q, layout, bits, 2), spec.dequantize_sum(q, layout, bits, 2))


# --------------------------------------------------------------------------------------------------------
# out= variants


@pytest.mark.parametrize("bits", BITS)
def test_out_arguments(tk, bits):
    layout = BlockLayout((9, 0, 33), 16)
    x = torch.randn(3, layout.numel, generator=gen(11)).to(torch.bfloat16)
    ref = spec.quantize(x, layout, bits)
    buf = QuantizedRows(torch.empty(3, payload_bytes(layout, bits), dtype=torch.uint8),
                        torch.empty(3, layout.num_blocks))
    answer = tk.raw("quantize", x, layout, bits, out=buf)
    assert answer[0] == "ok" and answer[2], "quantize(out=) must return out"
    assert_same_rows(answer[1], ref)
    flat = torch.empty(3 * layout.numel, dtype=torch.bfloat16)  # any shape with the right numel
    answer = tk.raw("dequantize", ref, layout, bits, torch.bfloat16, out=flat)
    assert answer[0] == "ok" and answer[2]
    assert same_bits(answer[1].view(3, -1), spec.dequantize(ref, layout, bits, torch.bfloat16))
    answer = tk.raw("dequantize_sum", ref, layout, bits, 3, out=torch.empty(layout.numel), divisor=3)
    assert answer[0] == "ok" and answer[2]
    assert same_bits(answer[1].view(1, -1), spec.dequantize_sum(ref, layout, bits, 3, divisor=3))
    one = QuantizedRows(torch.empty(1, payload_bytes(layout, bits), dtype=torch.uint8),
                        torch.empty(1, layout.num_blocks))
    answer = tk.raw("dequantize_sum_quantize", ref, layout, bits, 3, out=one)
    assert answer[0] == "ok" and answer[2]
    assert_same_rows(answer[1], spec.dequantize_sum_quantize(ref, layout, bits, 3))
    wrong = tk.raw("dequantize", ref, layout, bits, torch.float32, out=flat)
    assert wrong[0] == "error" and wrong[1] == "ValueError"


def _whole(view: torch.Tensor, rows: int) -> torch.Tensor:
    """The whole buffer a (pickled and returned) row view lives in, as ``rows`` rows."""
    return torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage()).view(rows, -1)


@pytest.mark.parametrize("bits", BITS)
def test_rows_apart_are_read_and_written_in_place(tk, bits):
    """Data rows that sit apart (a wire buffer's data part): written and read in place, the spec's bits."""
    layout = BlockLayout((7, 0, 33, 5), 8)
    pb, nb = payload_bytes(layout, bits), layout.num_blocks
    x = torch.randn(4, layout.numel, generator=gen(18))
    want = spec.quantize(x, layout, bits)
    wire = torch.full((4, pb + 4 * nb), 0xAB, dtype=torch.uint8)
    got = tk("quantize", x, layout, bits, out=QuantizedRows(wire[:, :pb], torch.empty(4, nb)))
    assert torch.equal(got.data, want.data) and bool((_whole(got.data, 4)[:, pb:] == 0xAB).all())
    wire[:, :pb] = want.data
    q = QuantizedRows(wire[:, :pb], want.scales)
    assert same_bits(tk("dequantize_sum", q, layout, bits, 2, divisor=4),
                     spec.dequantize_sum(want, layout, bits, 2, divisor=4))
    wire2 = torch.full((2, pb + 4 * nb), 0xCD, dtype=torch.uint8)
    got = tk("dequantize_sum_quantize", q, layout, bits, 2, out=QuantizedRows(wire2[:, :pb], torch.empty(2, nb)))
    assert_same_rows(QuantizedRows(got.data.clone(), got.scales), spec.dequantize_sum_quantize(want, layout, bits, 2))
    assert bool((_whole(got.data, 2)[:, pb:] == 0xCD).all())


def test_argument_errors_match_the_spec(tk):
    layout = BlockLayout((10,), 4)
    q = spec.quantize(torch.randn(4, 10, generator=gen(12)), layout, 8)
    assert tk.raw("dequantize_sum", q, layout, 8, 3)[:2] == ("error", "ValueError")  # 3 does not divide 4
    assert tk.raw("dequantize_sum", q, layout, 8, 2, divisor=0)[:2] == ("error", "ValueError")
    assert tk.raw("quantize", torch.randn(10), layout, 3)[:2] == ("error", "ValueError")
    assert tk.raw("quantize", torch.ones(10, dtype=torch.int32), layout, 8)[:2] == ("error", "TypeError")


if __name__ == "__main__" and WORKER_FLAG in sys.argv:
    _serve()
