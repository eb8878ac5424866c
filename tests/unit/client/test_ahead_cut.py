"""Leases taken ahead (get(prefetch=n)): an acquire's inline columns cut into each lease's samples as
received runs over the same bytes, not decoded into per-sample values first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dockd import codec
from dockd._proto import dockd_pb2 as pb
from dockd.client.ahead import cut, split
from dockd.client.batch import Batch
from dockd.client.lease import Lease

RAGGED = [torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * n for n in (2, 0, 5, 1, 3, 4, 1)]
COLUMNS = {
    "ragged": torch.nested.as_nested_tensor(RAGGED, layout=torch.jagged),  # one ragged run with rows of 3
    "tokens": [torch.arange(n, dtype=torch.int64) for n in (4, 1, 0, 3, 2, 5, 6)],  # joined ragged 1-D
    "fixed": torch.arange(14, dtype=torch.int16).view(7, 2),  # one run of equal shapes
    "scalar": torch.arange(7, dtype=torch.float64),  # one number per sample
    "py": ["a", {"k": [1, 2]}, None, 3.5, "longer text", [], -1],  # msgpack, each value's bytes in lengths
}


def received(*puts: dict) -> dict[str, codec.Runs]:
    """The columns of `puts` as a reply carrying them would decode lazily: one run per put and column."""
    body = codec.Body()
    cols = [codec.encode_columns(p, body) for p in puts]
    merged = []
    for name in puts[0]:
        col = pb.ColumnData(name=name)
        for c in cols:
            col.runs.extend(next(x for x in c if x.name == name).runs)
        merged.append(col)
    raw = np.frombuffer(bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers)), dtype=np.uint8)
    return dict(zip(puts[0], codec.decode_reply(merged, {0: (raw, 0)}, lazy=True)))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("a,b", [(0, 7), (0, 3), (3, 6), (6, 7), (2, 5), (1, 2)])
def test_a_cut_holds_the_values_of_its_samples_of_every_kind_of_run(a, b):
    whole = received(COLUMNS)
    for name, runs in whole.items():
        part = cut(runs, a, b)
        assert isinstance(part, codec.Runs) and len(part) == b - a
        expect = runs.values()[a:b]
        got = part.values()
        assert len(got) == len(expect) and all(same(x, y) for x, y in zip(got, expect)), name


def test_a_cut_across_the_runs_of_two_puts_takes_the_samples_of_each():
    second = {k: (v[:3] if not isinstance(v, torch.Tensor) or not v.is_nested else
                  torch.nested.as_nested_tensor(RAGGED[:3], layout=torch.jagged)) for k, v in COLUMNS.items()}
    whole = received(COLUMNS, second)  # 10 samples: 7 in the first run of each column, 3 in the second
    for name, runs in whole.items():
        assert len(runs.runs) == 2
        for a, b in ((5, 9), (0, 10), (7, 10), (6, 7)):
            got, expect = cut(runs, a, b).values(), runs.values()[a:b]
            assert len(got) == b - a and all(same(x, y) for x, y in zip(got, expect)), (name, a, b)


def test_a_jagged_column_of_a_lease_taken_ahead_is_a_view_of_the_reply():
    """Each lease's jagged column is one view of the received bytes, the next lease's right after it:
    the window's gets neither decode per-sample values nor copy the column (they did, with lazy=False)."""
    runs = received(COLUMNS)
    inline = {c: runs[c] for c in COLUMNS}
    lease = Lease(1, "p", list(COLUMNS), list(range(7)), None, inline, parts=[1, 2, 3])  # 3 gets of up to 3
    leases = split(lease, 3)
    assert [x.indexes for x in leases] == [[0, 1, 2], [3, 4, 5], [6]]
    batches = [Batch("p", x.indexes, dict(x.inline)) for x in leases]
    views = [b.jagged("ragged").values() for b in batches]
    base = runs["ragged"].jagged().values()
    for k, v in enumerate(views):
        lo = sum(len(t) for t in RAGGED[: 3 * k])
        assert v.data_ptr() == base[lo:].data_ptr()  # (not a copy: the reply's bytes where that lease's begin)
        assert torch.equal(v, torch.cat(RAGGED[3 * k: 3 * k + 3]))
    assert batches[1].stacked("fixed").data_ptr() == runs["fixed"].stacked()[3:].data_ptr()
    assert batches[2]["py"] == [-1] and batches[0]["py"] == COLUMNS["py"][:3]


def test_a_list_is_sliced_and_a_run_without_its_sizes_is_decoded_then_sliced():
    assert cut([1, 2, 3, 4], 1, 3) == [2, 3]
    runs = received({"py": ["a", "bb", "ccc"]})["py"]
    del runs.runs[0][0].lengths[:]  # (a sender that did not say each value's bytes)
    assert cut(runs, 1, 3) == ["bb", "ccc"]


def test_a_window_is_cut_as_the_controller_cut_it_not_evenly():
    """12 samples granted in leases of 8: 8 and 4, as the controller holds them. Cut evenly (6 and 6),
    confirming the first lease took two samples the client had not handed out, and releasing the second
    lost them (the kill-9 soak with prefetch found it)."""
    lease = Lease(1, "p", ["x"], list(range(12)), None, {"x": list(range(100, 112))}, parts=[1, 2])
    leases = split(lease, 8)
    assert [(x.id, x.indexes) for x in leases] == [(1, list(range(8))), (2, list(range(8, 12)))]
    assert leases[1].inline["x"] == list(range(108, 112))
