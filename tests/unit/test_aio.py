"""AioPool: round trips (dtypes, odd sizes, larger than a buffer, O_DIRECT and buffered, aligned zero-copy
tensors), concurrency and ordering, cleanup, and the start-up errors."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch

from zeropp.offload import AioPool, OffloadError
from zeropp.offload.aio import aligned_empty

BUF = 8192  # small buffers so that every tensor below is chunked


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "f32_small": torch.randn(3, generator=gen),
        "f32_odd": torch.randn(12_345, generator=gen),                      # 49,380 bytes: 7 chunks, ragged
        "bf16_odd": torch.randn(7, 1001, generator=gen).to(torch.bfloat16),  # 2-D, 14,014 bytes
        "f32_exact": torch.randn(4 * BUF // 4, generator=gen),               # exactly 4 buffers
        "i8": torch.randint(-128, 127, (5000,), generator=gen, dtype=torch.int8),
        "empty": torch.empty(0),
    }


@pytest.mark.parametrize("direct", [None, False])
def test_round_trip(tmp_path, direct):
    with AioPool(tmp_path, buffer_count=3, buffer_size=BUF, direct=direct) as pool:
        ts = _tensors()
        handles = [pool.write_async(k, t) for k, t in ts.items()]
        for h in handles:
            h.wait()
        outs = {k: torch.empty_like(t) for k, t in ts.items()}
        handles = [pool.read_async(k, outs[k]) for k in ts]
        assert [h.wait() for h in handles] == [t.numel() * t.element_size() for t in ts.values()]
        for k, t in ts.items():
            assert torch.equal(outs[k], t), k
        assert pool.nbytes("f32_odd") == 12_345 * 4 and pool.nbytes("nope") is None


def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    """File systems that refuse O_DIRECT (EINVAL; tmpfs before Linux 6.6) get buffered I/O; forcing O_DIRECT
    there is an error."""
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with AioPool(tmp_path, 2, BUF) as pool:
        assert not pool.direct
        t = torch.randn(5000)
        pool.write_async("x", t).wait()  # buffered: fdatasync + DONTNEED on completion
        out = torch.empty_like(t)
        pool.read_async("x", out).wait()
        assert torch.equal(out, t)
    with pytest.raises(OffloadError, match="O_DIRECT refused"):
        AioPool(tmp_path, 1, BUF, direct=True)


def test_aligned_tensors_skip_the_staging_buffers(tmp_path):
    src = aligned_empty(3 * BUF // 4 + 5)  # full aligned chunks go direct, the ragged tail is staged
    src.copy_(torch.randn(src.numel()))
    dst = aligned_empty(src.numel())
    with AioPool(tmp_path, 1, BUF) as pool:
        pool.write_async("a", src).wait()
        pool.read_async("a", dst).wait()
    assert src.data_ptr() % 4096 == 0 and torch.equal(dst, src)


def test_concurrent_requests_and_same_name_ordering(tmp_path):
    gen = torch.Generator().manual_seed(1)
    ts = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 20_000, (24,), generator=gen)]
    with AioPool(tmp_path, buffer_count=2, buffer_size=BUF, threads=4) as pool:
        hs = [pool.write_async(f"t{i}", t) for i, t in enumerate(ts)]  # far more chunks than buffers
        errors = []

        def reader(lo: int) -> None:
            try:
                for i in range(lo, len(ts), 3):
                    out = torch.empty_like(ts[i])
                    pool.read_async(f"t{i}", out).wait()  # ordered after its write
                    assert torch.equal(out, ts[i])
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        for h in hs:
            h.wait()
        # rewrite one name twice without waiting: the later write wins, the read sees it
        a, b = torch.zeros_like(ts[0]), torch.ones_like(ts[0])
        pool.write_async("t0", a)
        pool.write_async("t0", b)
        out = torch.empty_like(b)
        pool.read_async("t0", out).wait()
        assert torch.equal(out, b)
        pool.wait_all()


def test_files_are_per_rank_and_removed_on_close_and_gc(tmp_path):
    pool = AioPool(tmp_path, 1, BUF, rank=3, tag="param")
    assert os.path.basename(pool.path).startswith("zeropp-param-rank3-")
    assert os.path.exists(pool.path)
    pool.write_async("x", torch.randn(100)).wait()
    pool.close()
    assert not os.path.exists(pool.path)
    pool.close()  # idempotent
    with pytest.raises(OffloadError, match="closed"):
        pool.write_async("x", torch.randn(100))
    pool2 = AioPool(tmp_path, 1, BUF, rank=4)
    path = pool2.path
    del pool2
    gc.collect()
    assert not os.path.exists(path)


def test_files_removed_at_interpreter_exit(tmp_path):
    code = ("import sys, torch; from zeropp.offload import AioPool\n"
            "p = AioPool(sys.argv[1], 1, 8192, capacity=1 << 20); p.write_async('x', torch.ones(10)).wait()\n"
            "print(p.path)\n")  # exits without close()
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match="a_file"):
        AioPool(blocker / "sub", 1, BUF)




def test_not_enough_disk_is_a_clear_error_with_the_numbers(tmp_path):
    absurd = 1 << 62  # 4 EiB
    with pytest.raises(OffloadError) as err:
        AioPool(tmp_path, 1, BUF, capacity=absurd)
    msg = str(err.value)
    assert str(tmp_path) in msg and f"{absurd:,}" in msg and "free" in msg
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_capacity_is_reserved_and_enforced(tmp_path):
    with AioPool(tmp_path, 1, BUF, capacity=3 * 4096) as pool:
        assert os.path.getsize(pool.path) == 3 * 4096  # preallocated at start-up
        pool.write_async("a", torch.randn(2000)).wait()  # 8000 bytes -> two 4 KiB blocks
        with pytest.raises(OffloadError, match="capacity"):
            pool.write_async("b", torch.randn(2000))


def test_misuse_errors(tmp_path):
    with AioPool(tmp_path, 1, BUF) as pool:
        with pytest.raises(KeyError):
            pool.read_async("missing", torch.empty(3))
        pool.write_async("a", torch.randn(10)).wait()
        with pytest.raises(ValueError, match="holds 40 bytes"):
            pool.read_async("a", torch.empty(11))
        with pytest.raises(ValueError, match="holds 40 bytes"):
            pool.write_async("a", torch.randn(11))
        with pytest.raises(ValueError, match="contiguous"):
            pool.read_async("a", torch.empty(20)[::2])
    with pytest.raises(ValueError):
        AioPool(tmp_path, 0, BUF)
