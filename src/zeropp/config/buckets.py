"""How large gradient buckets are: the default ``reduce_bucket_size`` and what it bounds.

Note [bucket size]: ``reduce_bucket_size`` counts elements of the 16-bit gradient held in buckets at once, as
DeepSpeed's does (its one bucket of that many elements costs 2 bytes each). The engine keeps
``BUCKETS_IN_FLIGHT`` buckets (one reducing while backward fills the next), so each holds at most half of it;
a bucket is flushed before a gradient would overflow it, and only a parameter larger than half the setting
is reduced on its own, in a bucket of its size. So the gradient buckets take at most
``2 B x max(reduce_bucket_size, 2 x the largest parameter)``.

Left unset, the size follows the model: a quarter of its trainable elements (about eight buckets per
backward, so the reduction of the first overlaps the rest of backward even on a small model), at least
``DEFAULT_FLOOR`` (a bucket smaller than half a million elements pays more in per-collective latency than it
gains in overlap: docs/benchmarks.md, "Default buckets") and at most ``DEFAULT_CAP`` (400 MB of 16-bit
gradient, against the 1 GB DeepSpeed's default of 5e8 costs). With a world of one rank nothing is reduced
and no bucket exists (``GradBuckets.direct``).
"""
from __future__ import annotations

BUCKETS_IN_FLIGHT = 2  # one bucket reducing while backward fills the next (zero/buckets.py)
DEFAULT_BUCKETS_PER_BACKWARD = 8
DEFAULT_FLOOR = 1_000_000
DEFAULT_CAP = 200_000_000


def default_reduce_bucket_size(trainable_elements: int) -> int:
    """``reduce_bucket_size`` when the config leaves it out (Note [bucket size])."""
    share = -(-trainable_elements * BUCKETS_IN_FLIGHT // DEFAULT_BUCKETS_PER_BACKWARD)
    return min(DEFAULT_CAP, max(DEFAULT_FLOOR, share))


def bucket_capacity(reduce_bucket_size: int) -> int:
    """Padded elements one bucket is flushed at: its share of the buckets in flight."""
    return reduce_bucket_size // BUCKETS_IN_FLIGHT


def largest_bucket(reduce_bucket_size: int, largest_parameter: int) -> int:
    """Elements of the largest bucket: the capacity, or a larger parameter reduced alone."""
    return max(bucket_capacity(reduce_bucket_size), largest_parameter)
