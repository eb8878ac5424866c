"""`benchmarks.common.touch`, which every timed get ends with: it faults in every page of every tensor it is
handed, and nothing else. Checked on fresh anonymous memory through /proc/self/pagemap (no timing here)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from benchmarks.common import PAGE, touch

PAGES = 48


def _present(base: int) -> list[bool]:
    """Whether each of the PAGES pages from `base` is mapped in this process (pagemap bit 63)."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        raw = os.pread(fd, PAGES * 8, base // PAGE * 8)
    finally:
        os.close(fd)
    return [bool(int.from_bytes(raw[i * 8:i * 8 + 8], "little") >> 63) for i in range(PAGES)]


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_touch_faults_in_every_page_of_every_tensor_and_no_other():
    import torch

    mm = mmap.mmap(-1, PAGES * PAGE)  # fresh anonymous pages: none mapped until read
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert not any(_present(base))
    pages = lambda first, n: whole[first * PAGE:(first + n) * PAGE]  # noqa: E731
    values = [
        pages(0, 1),  # one page
        pages(2, 3),  # a few pages, read where they lie
        pages(6, 1).view(torch.bfloat16),  # a dtype numpy lacks
        [pages(8, 1)[:100], pages(9, 1)[:1]],  # short values, in a list
        {"big": pages(10, 20)},  # more pages than the direct path takes: through numpy
        pages(31, 4).view(4, PAGE)[:, :8].t(),  # not contiguous: its 4 rows' pages
        pages(36, 0),  # empty
    ]
    assert touch(values) == 8
    read = {0, 2, 3, 4, 6, 8, 9, *range(10, 30), 31, 32, 33, 34}
    assert _present(base) == [i in read for i in range(PAGES)]


def test_touch_refuses_what_is_not_tensors():
    with pytest.raises(TypeError, match="touch\\(\\) expects tensors"):
        touch([b"bytes"])
