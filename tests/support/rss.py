"""Peak resident memory of a rank over a stretch of its work, as the kernel counts it."""
from __future__ import annotations

import os
import resource


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss(since_reset: bool) -> int:
    """VmHWM after a reset, else ru_maxrss: the process's peak since start-up (which only over-counts)."""
    if since_reset:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# glibc raises its mmap threshold as large blocks are freed and then serves multi-MB tensors from a heap that
# long-lived shards fragment and that is never trimmed, so RSS would keep freed memory. A fixed threshold
# returns every large freed tensor to the OS, which makes peak RSS measure peak live allocations.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}
