"""ZeRO-Offload / ZeRO-Infinity building blocks (L3 helpers, no process groups).

* ``CpuAdam`` (``cpu_adam.py``): host Adam/AdamW for the fp32 master shards, bit-identical to torch's,
  one pass over memory, with the fused copy of the updated value into the 16-bit shard.
* ``AioPool`` (``aio.py``): asynchronous file I/O through a fixed pool of page-aligned buffers, for NVMe
  offload of parameters and optimizer state.
"""

from zeropp.offload.aio import AioHandle, AioPool, OffloadError
from zeropp.offload.cpu_adam import CpuAdam, KernelInfo, kernel_info

__all__ = ["AioHandle", "AioPool", "CpuAdam", "KernelInfo", "OffloadError", "kernel_info"]
