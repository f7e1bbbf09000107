"""The host links: HostLink moves nothing; ThreadedLink behaves like a separate device whose copies run
later, which is what lets the CPU tests show that the engine waits for every copy (tests/dist/test_offload.py)."""
from __future__ import annotations

import math

import torch

from zeropp.offload.link import HostLink, ThreadedLink, build_link


def test_host_link_download_is_the_row_itself_and_upload_copies():
    link = HostLink()
    row = torch.arange(6, dtype=torch.float32)
    t = link.download(row)
    assert t.done and t.wait() is row
    dst = torch.zeros(6, dtype=torch.bfloat16)
    assert link.upload(row, dst).wait() is dst
    assert torch.equal(dst, row.to(torch.bfloat16))
    assert not link.distinct


def test_threaded_download_is_poisoned_until_waited_and_reads_the_source_late():
    link = ThreadedLink(delay=0.05)
    src = torch.arange(5, dtype=torch.bfloat16)
    t = link.download(src)
    assert not t.done
    early = t._dst.clone()  # what a reader that skipped wait() would see
    assert all(math.isnan(v) for v in early.float().tolist())
    src.add_(100)  # a source changed before its copy ran: the copy shows it
    assert torch.equal(t.wait(), torch.arange(5, dtype=torch.bfloat16) + 100)
    assert link.copies == 1 and t.done


def test_threaded_upload_poisons_the_destination_and_wait_uploads_waits_for_it():
    link = ThreadedLink(delay=0.05)
    src = torch.full((4,), 3.0)
    dst = torch.zeros(4, dtype=torch.int32)
    t = link.upload(src, dst)
    assert torch.equal(dst, torch.full((4,), -1, dtype=torch.int32))
    link.wait_uploads()
    assert torch.equal(dst, torch.full((4,), 3, dtype=torch.int32)) and link.copies == 1
    assert t.wait() is dst


def test_threaded_copies_run_in_request_order():
    link = ThreadedLink(delay=0.01)
    dst = torch.zeros(3)
    for value in (1.0, 2.0, 3.0):
        link.upload(torch.full((3,), value), dst)
    link.wait_uploads()
    assert torch.equal(dst, torch.full((3,), 3.0))


def test_build_link_picks_by_device():
    assert type(build_link(torch.device("cpu"), True, True)) is HostLink
    assert type(build_link(torch.device("meta"), True, False)) is HostLink
    assert type(build_link(torch.device("cuda", 0), False, False)) is HostLink  # nothing offloaded
    assert type(build_link(torch.device("xpu"), True, False)) is HostLink  # synchronous copies where used
