"""The default ``reduce_bucket_size`` and what a bucket may hold (Note [bucket size] in ``config/policy.py``)."""
from __future__ import annotations

from zeropp.config.policy import (BUCKETS_IN_FLIGHT, DEFAULT_CAP, DEFAULT_FLOOR, bucket_capacity,
                                 default_reduce_bucket_size, largest_bucket)


def test_the_default_gives_several_buckets_on_a_small_model_and_bounded_bytes_on_a_large_one() -> None:
    # a 23M-parameter model: eight buckets per backward, not the one DeepSpeed's 5e8 gives
    size = default_reduce_bucket_size(23_000_000)
    assert 23_000_000 // bucket_capacity(size) in (7, 8)
    # a tiny model still gets the floor (per-collective latency), a 70B one the cap (2 x 2e8 x 2 B = 800 MB)
    assert default_reduce_bucket_size(10_000) == DEFAULT_FLOOR
    assert default_reduce_bucket_size(70_000_000_000) == DEFAULT_CAP
    assert 2 * DEFAULT_CAP < 500_000_000 * 2  # 16-bit bytes at once below DeepSpeed's default bucket's


def test_a_bucket_holds_half_the_setting_or_one_larger_parameter() -> None:
    assert BUCKETS_IN_FLIGHT == 2 and bucket_capacity(500_000_000) == 250_000_000
    assert largest_bucket(1000, 300) == 500 and largest_bucket(1000, 700) == 700
    assert largest_bucket(0, 64) == 64  # 0: every parameter reduced on its own
