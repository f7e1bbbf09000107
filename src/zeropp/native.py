"""Build-at-first-use for the small C kernels: compile with the system C compiler, cache the shared library,
load it with ctypes.

Used by ``quant/fast.py`` (block quantizers) and ``offload/cpu_adam.py`` (host Adam):

* compiler: ``$CC``, else ``cc`` / ``gcc`` / ``clang`` on ``PATH``; none -> ``None`` and the caller falls back
  to its pure-torch path;
* flag variants are tried in order (e.g. ``-march=native -fopenmp`` first, plain last); the first that
  compiles wins;
* cache: ``$ZEROPP_CACHE_DIR``, else ``$XDG_CACHE_HOME/zeropp`` / ``~/.cache/zeropp``, else a per-user
  directory under the system temp dir; the file name carries a hash of the source, compiler, flags and the
  CPU's feature flags (builds use ``-march=native``), so a changed kernel or machine never loads a stale
  library;
* the library is compiled to a temporary name and renamed into place, so concurrent ranks racing to build the
  same key is harmless.

L0: no torch.distributed, no I/O beyond the cache directory.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

__all__ = ["C_FLOAT_BITS", "build_shared_library", "cache_dir", "compiler", "cpu_key", "openmp_variants", "torch_uses_libgomp"]


#: C helpers both kernels need: float bit casts and c10's exact fp16/bf16 conversions (needs <math.h>,
#: <stdint.h>, <string.h> included before it). Bit-identity with torch rests on these matching c10.
C_FLOAT_BITS = r"""
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE binary16 -> fp32, exact (c10's fp16_ieee_to_fp32_value). */
static inline float h2f(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float norm = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denorm = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    return u2f(sign | (two_w < (1u << 27) ? f2u(denorm) : f2u(norm)));
}
/* fp32 -> binary16, round to nearest even (c10's fp16_ieee_from_fp32_value). */
static inline uint16_t f2h(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f2u(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    uint32_t bits = f2u(u2f((bias >> 1) + 0x07800000u) + base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
/* fp32 -> bfloat16, round to nearest even (c10's round_to_nearest_even). */
static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}
"""


def compiler() -> str | None:
    """The C compiler to use, or None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_dir() -> str:
    """A writable directory for built libraries (created if needed)."""
    base = os.environ.get("ZEROPP_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "zeropp")
    try:
        os.makedirs(base, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    base = os.path.join(tempfile.gettempdir(), f"zeropp-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(base, exist_ok=True)
    return base


def cpu_key() -> str:
    """The CPU's feature flags (part of the cache key because builds use -march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def torch_uses_libgomp() -> bool:
    """True when the process has a library named libgomp.so.1 mapped (torch's OpenMP runtime on Linux).

    A ``-fopenmp`` build then binds to that same runtime by soname and shares torch's thread pool; with any
    other runtime it would start a second pool that fights torch's spinning workers for the cores, so callers
    build with pthreads instead."""
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith("/libgomp.so.1") for line in f)
    except OSError:
        return False


def openmp_variants(env_var: str) -> tuple[list[str], ...]:
    """The usual flag variants, best first; the OpenMP ones only when torch's libgomp is loaded and
    ``$env_var`` is not "0"."""
    variants = (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], [])
    if os.environ.get(env_var, "1") == "0" or not torch_uses_libgomp():
        variants = tuple(v for v in variants if "-fopenmp" not in v)
    return variants


def build_shared_library(name: str, source: str, base_flags: Sequence[str], variants: Sequence[Sequence[str]],
                         libs: Sequence[str] = ("-lm",)) -> str | None:
    """Compile ``source`` (C) into ``<cache>/zeropp_<name>_<hash>.so`` with the first flag variant that works,
    or return the cached library. None when no compiler is found or every variant fails."""
    cc = compiler()
    if not cc:
        return None
    for extra in variants:
        flags = [*base_flags, *extra]
        key = hashlib.sha256("\0".join([source, cc, *flags, *libs, cpu_key()]).encode()).hexdigest()[:16]
        so = os.path.join(cache_dir(), f"zeropp_{name}_{key}.so")
        if os.path.exists(so):
            return so
        fd, tmp_so = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(so))
        os.close(fd)
        src = tmp_so[:-3] + ".c"
        try:
            with open(src, "w") as f:
                f.write(source)
            res = subprocess.run([cc, *flags, src, "-o", tmp_so, *libs], capture_output=True, timeout=120, check=False)
            if res.returncode == 0:
                os.replace(tmp_so, so)  # atomic: concurrent builders of the same key are harmless
                return so
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            for p in (src, tmp_so):
                if os.path.exists(p):
                    os.unlink(p)
    return None
