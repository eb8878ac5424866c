"""A staged payload copied into a warehouse's storage in two steps (a lent staging buffer)."""

from __future__ import annotations

import numpy as np

from dockd.warehouse.admission import Admission
from dockd.warehouse.core import Warehouse
from dockd.warehouse.segments import Segments


def test_the_bytes_checked_before_the_answer_are_the_bytes_kept():
    """The ranges the put's checks read are copied first; the rest, copied after the answer, never
    overwrites them, so a writer that scribbles on its lent buffer in between cannot change values
    that were checked (its msgpack values stay the ones that decoded)."""
    size = 3 << 20  # a segment of the pool
    staged = np.arange(size, dtype=np.uint64).astype(np.uint8)
    adm = Admission(Warehouse(1 << 30), Segments(keep_bytes=0), lambda: 0)
    adm.segment_budget = 8  # (into a segment of the pool, as a daemon does)
    first = [(100, 50), (2 << 20, 4096), (size - 10, 10)]
    body, rest = adm.copy_in_later(staged, size, first)
    got = np.frombuffer(body.buffer, dtype=np.uint8, count=size)
    for off, n in first:
        assert np.array_equal(got[off : off + n], staged[off : off + n])
    original = staged.copy()
    staged[:] = 7  # the writer writes into its buffer before the rest is copied
    rest()
    for off, n in first:
        assert np.array_equal(got[off : off + n], original[off : off + n]), "a checked range was copied again"
    checked = np.zeros(size, dtype=bool)
    for off, n in first:
        checked[off : off + n] = True
    assert (got[~checked] == 7).all()
