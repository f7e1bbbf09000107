"""SwapStore: tensors keep their identity while their bytes move between memory and the offload file, and
the bytes resident at once never exceed the budget."""
from __future__ import annotations

import pytest
import torch

from zeropp.offload.aio import AioPool, OffloadError
from zeropp.offload.swap import SwapStore


@pytest.fixture
def store(tmp_path):
    pool = AioPool(tmp_path, 2, 1 << 16)
    yield SwapStore(pool, budget=3 * 4096, sized_by="test.buffer_count")
    pool.close()


def test_put_frees_memory_and_get_brings_the_same_values_back(store):
    t = torch.arange(1024, dtype=torch.float32)
    view = t[10:20]
    store.put("a", t)
    store.flush()
    assert t.untyped_storage().nbytes() == 0 and store.resident_bytes == 0
    assert store.get("a") is t
    assert torch.equal(t, torch.arange(1024, dtype=torch.float32))
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))  # views see the restored storage


def test_dirty_release_writes_and_clean_release_discards(store):
    t = torch.zeros(1024)
    store.put("a", t)
    store.get("a").fill_(3.0)
    store.release("a", dirty=True)
    store.get("a").fill_(7.0)
    store.release("a", dirty=False)  # the 7s were never written
    assert torch.equal(store.get("a"), torch.full((1024,), 3.0))


def test_zeros_need_no_io(store):
    t = torch.ones(1024)
    store.put("g", t, zeros=True)
    assert store.pool.bytes_written == 0
    assert torch.equal(store.get("g"), torch.zeros(1024)) and store.pool.bytes_read == 0
    store.get("g").add_(2.0)
    store.release("g")
    store.forget_contents("g")
    assert torch.equal(store.get("g"), torch.zeros(1024))


def test_budget_skips_optional_prefetch_and_names_the_key_when_required(store):
    tensors = {n: torch.full((1024,), float(i)) for i, n in enumerate("abcd")}
    for n, t in tensors.items():
        store.put(n, t)
    store.flush()
    store.reset_peak()  # start-up puts may hold writes in flight beyond the budget; use is measured from here
    for n in "abc":
        assert store.fetch(n)
    assert store.resident_bytes == 3 * 4096
    assert store.fetch("d", optional=True) is False
    with pytest.raises(OffloadError, match="raise test.buffer_count"):
        store.get("d")
    store.release("a", dirty=False)
    assert torch.equal(store.get("d"), torch.full((1024,), 3.0))
    assert store.peak_bytes <= store.budget


def test_reserve_counts_tensors_made_outside_and_put_takes_them_over(store):
    store.put("a", torch.zeros(1024))
    store.get("a")
    store.reserve(2 * 4096)
    assert store.resident_bytes == 3 * 4096
    with pytest.raises(OffloadError):
        store.reserve(4096)
    store.put("m", torch.ones(1024))  # consumes the reservation: no double count
    store.flush()
    store.unreserve()
    assert store.resident_bytes == 4096


def test_replacing_a_tensor_under_a_name_keeps_the_new_one(store):
    old, new = torch.zeros(1024), torch.full((1024,), 5.0)
    store.put("s", old)
    store.put("s", new)
    store.flush()
    assert store.get("s") is new and torch.equal(new, torch.full((1024,), 5.0))


def test_tensors_that_share_or_cannot_resize_their_storage_are_refused(store):
    big = torch.zeros(8192)
    assert not SwapStore.can_take(big[:1024])  # shares its storage with 7 KiB more
    assert not SwapStore.can_take(torch.frombuffer(bytearray(4096), dtype=torch.float32))
    with pytest.raises(ValueError, match="resizable"):
        store.put("x", big[:1024])


def test_a_needed_shard_displaces_shards_read_ahead(tmp_path):
    """The gather that needs a shard gets a buffer even when read-aheads for a path not taken hold them."""
    from types import SimpleNamespace

    from zeropp.offload.residency import NvmeResidency

    pool = AioPool(tmp_path, 2, 1 << 16)
    try:
        store = SwapStore(pool, budget=100 * 4, sized_by="test")
        for i, n in enumerate((60, 70, 40)):
            store.put(f"{i}.shard", torch.full((n,), float(i)))
        store.flush()
        res = NvmeResidency(store, None, shard_buffer_bytes=70 * 4, states_buffer_count=0)
        unit = [SimpleNamespace(index=i) for i in range(3)]
        assert res.shard_in(unit[0])
        assert not res.shard_in(unit[1], optional=True)  # no room beside unit 0: the prefetch is skipped
        res.prefetch_shard(unit[2])  # fits: read ahead
        res.shard_done(unit[0])
        assert res.shard_in(unit[1])  # needs 70 with 40 read ahead: the read-ahead gives way
        assert torch.equal(store.get("1.shard"), torch.full((70,), 1.0))
        assert not store.is_resident("2.shard")
    finally:
        pool.close()
