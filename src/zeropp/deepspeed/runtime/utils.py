"""``deepspeed.runtime.utils``: ``see_memory_usage``, the memory print DeepSpeed's scripts and tests sprinkle
between phases (``see_memory_usage("post-init", force=True)``)."""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

__all__ = ["see_memory_usage"]

_GB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and the memory in use, as DeepSpeed does: nothing unless ``force``, and only on rank 0 of a
    process group. The accelerator's allocated and reserved bytes (now and at peak, whose counter is reset after;
    0 without CUDA) and the host's virtual memory in use."""
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # as DeepSpeed: collect first, for a truer reading
    print(message)
    cuda = torch.cuda.is_available()
    ma, max_ma = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) if cuda else (0, 0)
    ca, max_ca = (torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()) if cuda else (0, 0)
    print(f"MA {round(ma / _GB, 2)} GB         Max_MA {round(max_ma / _GB, 2)} GB         CA {round(ca / _GB, 2)} GB "
          f"        Max_CA {round(max_ca / _GB)} GB ")
    used, percent = _host_memory()
    print(f"CPU Virtual Memory:  used = {used} GB, percent = {percent}%")
    if cuda:
        torch.cuda.reset_peak_memory_stats()


def _host_memory() -> tuple[float, float]:
    """(GB in use, percent in use) of the host's memory: psutil's reading when it is installed, else /proc/meminfo."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return round((vm.total - vm.available) / _GB, 2), vm.percent
    info: dict[str, int] = {}
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    return round((total - available) / _GB, 2), round(100 * (total - available) / total, 1) if total else 0.0
