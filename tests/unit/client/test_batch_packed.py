"""batch.packed(col): a ragged column as the dockd.Jagged (values, offsets) pair a put takes, without torch's
nested tensor: the values jagged() would hold (the same view of the received bytes), the n + 1 offsets."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import dockd
from dockd import codec
from dockd.client.batch import Batch
from dockd.errors import DockTypeError, DockValueError

warnings.filterwarnings("ignore", message="The given buffer is not writable")


def received(**columns) -> Batch:
    """A batch of `columns` as a get decodes a reply carrying them (each column's runs kept)."""
    body = codec.Body()
    cols = codec.encode_columns(columns, body)
    raw = np.frombuffer(bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in body.buffers)), dtype=np.uint8)
    n = len(next(iter(columns.values())))
    return Batch("p", list(range(n)), dict(zip(columns, codec.decode_reply(cols, {0: (raw, 0)}, lazy=True))))


@pytest.mark.parametrize("trail", [(), (3,), (2, 2)])
def test_packed_is_the_view_and_offsets_jagged_holds(trail):
    rows = [torch.randn(n, *trail) for n in (4, 0, 7, 1)]
    b = received(x=torch.nested.as_nested_tensor(rows, layout=torch.jagged))
    pair, nt = b.packed("x"), b.jagged("x")
    assert isinstance(pair, dockd.Jagged)
    assert pair.values.shape == (12, *trail) and pair.offsets.dtype == torch.int64
    assert pair.offsets.tolist() == [0, 4, 4, 11, 12] == nt.offsets().tolist()
    assert pair.values.data_ptr() == nt.values().data_ptr()  # (the same view of the reply's bytes: no copy)
    assert all(torch.equal(pair.values[a:z], r) for a, z, r in zip(pair.offsets, pair.offsets[1:], rows))


def test_packed_of_per_sample_values_joins_them_and_of_equal_shapes_gives_equal_lengths():
    b = received(ids=[torch.arange(n) for n in (3, 1, 2)], fixed=torch.arange(12).view(3, 2, 2))
    ids = b.packed("ids")
    assert ids.values.tolist() == [0, 1, 2, 0, 0, 1] and ids.offsets.tolist() == [0, 3, 4, 6]
    fixed = b.packed("fixed")
    assert torch.equal(fixed.values, torch.arange(12).view(6, 2)) and fixed.offsets.tolist() == [0, 2, 4, 6]
    b["ids"]  # (the column made into its list: packed joins the values, a copy)
    assert b.packed("ids").values.tolist() == [0, 1, 2, 0, 0, 1]


def test_a_packed_pair_goes_back_in_as_a_put_takes_it():
    rows = [torch.arange(n, dtype=torch.int32) for n in (2, 5, 0)]
    pair = received(x=torch.nested.as_nested_tensor(rows, layout=torch.jagged)).packed("x")
    again = received(x=codec.jagged("x", pair)).jagged("x")  # (what a put of the pair encodes)
    assert [t.tolist() for t in again.unbind()] == [r.tolist() for r in rows]


def test_packed_refuses_what_jagged_refuses_naming_the_call():
    b = received(s=["a", "b"], mixed=[torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(DockTypeError, match="packed"):
        b.packed("s")
    with pytest.raises(DockValueError, match=r"packed\(\) needs values ragged in their first dimension only"):
        b.packed("mixed")
    with pytest.raises(KeyError, match="not in this batch"):
        b.packed("nope")
