"""Whether this CPU multiplies bf16 matrices fast, for the demo's default precision.

Without AVX512-BF16 or AMX (an AVX2-only x86 CPU), torch's CPU kernels convert bf16 to fp32 element by element,
and a bf16 matmul runs about 30x slower than the fp32 one: the demo's 60 steps took 6.5 minutes on such a VM
against under 2 on an AVX-512 machine. There the demo trains in fp32 instead, and says so.
"""
from __future__ import annotations

import platform
import time
from typing import NamedTuple

# x86 flags (as /proc/cpuinfo spells them) of the instructions torch's bf16 matmul kernels use
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
SLOW_RATIO = 4.0  # measured only where flags cannot be read: a bf16 matmul this many times fp32's is slow


class Bf16Speed(NamedTuple):
    fast: bool
    why: str  # what the answer rests on, for the line that reports it


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _measured_ratio() -> float:
    """bf16 over fp32 time of one 256 x 256 matmul (best of 5): where no flags tell."""
    import torch
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256).to(dtype)
        a @ a
        times = []
        for _ in range(5):
            t = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t)
        best[dtype] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def bf16_speed() -> Bf16Speed:
    """Whether bf16 matmuls are fast on this CPU, and why the answer is what it is."""
    flags = _cpu_flags() if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86") else None
    if flags is not None:
        have = [f for f in FAST_BF16_FLAGS if f in flags]
        if have:
            return Bf16Speed(True, f"the CPU has {', '.join(have).upper()}")
        return Bf16Speed(False, "the CPU has no AVX512-BF16 or AMX, so a bf16 matmul runs ~30x slower than fp32")
    ratio = _measured_ratio()
    if ratio > SLOW_RATIO:
        return Bf16Speed(False, f"a bf16 matmul measured {ratio:.0f}x slower than fp32 on this CPU")
    return Bf16Speed(True, f"a bf16 matmul measured {ratio:.1f}x fp32's time on this CPU")
