"""BufferPool (Note [buffer pool] in comm/buffers.py): reuse only after give, slabs sized to the largest
request, as many slabs as leases held at once, whatever the order of takes and gives."""
from __future__ import annotations

import itertools

import pytest
import torch

from zeropp.comm.buffers import BufferPool, BufferPools


def test_a_given_back_buffer_is_reused_and_a_held_one_never() -> None:
    pool = BufferPool()
    a = pool.take(100, torch.float32)
    b = pool.take(100, torch.float32)
    assert a.data_ptr() != b.data_ptr() and a.shape == (100,)
    pool.give(a)
    c = pool.take(60, torch.float32)
    assert c.data_ptr() == a.data_ptr() and c.numel() == 60
    assert c.data_ptr() != b.data_ptr()  # b is still lent out
    assert pool.allocations == 2 and pool.leased() == 2


def test_dtypes_and_devices_do_not_share_slabs() -> None:
    pool = BufferPool()
    a = pool.take(8, torch.float32)
    pool.give(a)
    b = pool.take(8, torch.uint8)
    assert b.dtype == torch.uint8 and pool.allocations == 2
    pool.give(b)
    assert pool.take(8, torch.float32).data_ptr() == a.data_ptr()


def test_give_of_a_foreign_or_returned_tensor_raises() -> None:
    pool = BufferPool()
    a = pool.take(4, torch.float32)
    with pytest.raises(ValueError, match="not taken from this pool"):
        pool.give(torch.empty(4))
    pool.give(a.view(2, 2))  # any view from the first element is the same buffer
    with pytest.raises(ValueError, match="given back already"):
        pool.give(a)


def test_slabs_grow_to_the_largest_request_and_small_ones_are_dropped() -> None:
    pool = BufferPool()
    small = pool.take(10, torch.float32)
    big = pool.take(50, torch.float32)
    pool.give(small)  # smaller than the largest request: dropped, not kept beside the big ones
    pool.give(big)
    assert pool.nbytes() == 50 * 4
    x, y = pool.take(10, torch.float32), pool.take(10, torch.float32)
    assert pool.nbytes() == 2 * 50 * 4 and pool.allocations == 3


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_no_allocation_once_warm_whatever_the_order(order: tuple[int, ...]) -> None:
    """Three leases of different sizes held at once, taken and given in every order: once the pool has seen
    the largest request and then the most leases at once (two rounds at most: here the first round's
    30-byte slab is dropped when the 70-byte request raises the size), it allocates nothing more (the
    timing of collectives changes the order from step to step)."""
    pool = BufferPool()
    sizes = (30, 70, 50)
    for _ in range(2):
        held = [pool.take(n, torch.uint8) for n in sizes]
        for t in held:
            pool.give(t)
    warm = pool.allocations
    assert warm == 4
    for rounds in itertools.permutations(range(3)):
        held = {i: pool.take(sizes[i], torch.uint8) for i in rounds}
        for i in order:
            pool.give(held[i])
    assert pool.allocations == warm and pool.leased() == 0
    assert pool.nbytes() == 3 * max(sizes)


def test_pools_report_bytes_by_role() -> None:
    pools = BufferPools("qwz", "send", "recv")
    t = pools["recv"].take(16, torch.uint8)
    assert pools.buffer_bytes() == {"qwz_send": 0, "qwz_recv": 16}
    assert pools.allocations() == 1 and pools.leased() == 1
    pools["recv"].give(t)
    assert pools.leased() == 0


def test_trim_drops_free_slabs_beyond_the_count_and_keeps_leased_ones() -> None:
    """After a step that held more buckets than usual (gradients out of layout order), the extra slabs go."""
    pool = BufferPool()
    held = [pool.take(8, torch.uint8) for _ in range(5)]
    for t in held[:4]:
        pool.give(t)
    pool.trim(3)
    assert pool.nbytes() == 3 * 8 and pool.leased() == 1
    pool.give(held[4])
    pool.trim(1)
    assert pool.nbytes() == 8
    before = pool.allocations
    pool.give(pool.take(8, torch.uint8))
    assert pool.allocations == before  # the kept slab serves the next request
