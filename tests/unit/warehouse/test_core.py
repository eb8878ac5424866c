"""The warehouse's pure logic: storage, capacity accounting, validation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dockd import codec, runcheck
from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockFull, DockNotFound, DockValueError
from dockd.warehouse.core import Warehouse


def encoded(values: list, name: str = "x"):
    body = codec.Body()
    cols = codec.encode_columns({name: values}, body)
    buf = pa.py_buffer(b"".join(bytes(b) for b in body.buffers))
    return cols, buf


def fetched(w: Warehouse, partition: str, name: str, indexes) -> list:
    """Values a fetch would send, decoded from the stored slices."""
    (_, slices), = w.fetch(partition, [(name, indexes)])
    out = []
    for batch, r0, r1 in slices:
        run, lo = batch.add_run(pb.ColumnData().runs, r0, r1)
        out += codec.decode_run(run, bytearray(batch.data.slice(lo, run.nbytes).to_pybytes()) or bytearray(1))
    return out


def test_store_fetch_free_and_accounting():
    w = Warehouse(1 << 20)
    cols, buf = encoded([torch.arange(4), torch.ones(2, 3)])
    assert w.reserve(buf.size)
    w.store("p", [0, 1], cols, buf, buf.size)
    assert (w.used, w.reserved) == (buf.size, 0)
    (_, slices), = w.fetch("p", [("x", [1, 0])])
    for batch, _, _ in slices:  # stored runs are zero-copy slices of the put's body
        assert buf.address <= batch.data.address < buf.address + buf.size
    got = fetched(w, "p", "x", [1, 0])
    assert torch.equal(got[0], torch.ones(2, 3)) and torch.equal(got[1], torch.arange(4))
    assert w.free("p") == buf.size and w.used == 0
    with pytest.raises(DockNotFound):
        w.fetch("p", [("x", [0])])


def test_consecutive_samples_of_a_put_are_one_slice_whatever_their_number():
    w = Warehouse(1 << 30)
    src = [torch.arange(n) for n in range(1, 1001)]
    cols, buf = encoded(src)
    w.reserve(buf.size)
    w.store("p", list(range(1000)), cols, buf, buf.size)
    (_, slices), = w.fetch("p", [("x", list(range(100, 900)))])
    assert len(slices) == 1 and slices[0][1:] == (100, 900)
    (_, slices), = w.fetch("p", [("x", [5, 6, 7, 50, 51, 3])])
    assert [s[1:] for s in slices] == [(5, 8), (50, 52), (3, 4)]
    got = fetched(w, "p", "x", [5, 6, 7, 50, 51, 3])
    assert [int(t[-1]) for t in got] == [5, 6, 7, 50, 51, 3]


def test_no_python_object_per_stored_value():
    import gc

    w = Warehouse(1 << 30)
    cols, buf = encoded(torch.zeros(20_000, 4))
    gc.collect()
    before = len(gc.get_objects())
    for k in range(10):  # 200,000 values in 10 puts
        w.reserve(buf.size)
        w.store("p", list(range(k * 20_000, (k + 1) * 20_000)), cols, buf, buf.size)
    gc.collect()
    assert len(gc.get_objects()) - before < 200  # a few objects per put, none per value


def test_capacity_reservations_and_never_fitting_puts():
    w = Warehouse(100)
    assert w.reserve(60)
    assert not w.reserve(50)
    w.unreserve(60)
    assert w.reserve(100)
    with pytest.raises(DockFull, match="can never fit"):
        w.check_fits(101)


def test_duplicate_columns():
    w = Warehouse(1 << 20)
    cols, buf = encoded([torch.zeros(1)])
    w.reserve(buf.size)
    w.store("p", [3], cols, buf, buf.size)
    with pytest.raises(DockValueError, match="already written"):
        w.check_absent("p", [3], ["x"])
    w.free("p")
    assert w.used == 0 and not w.has("p", [("x", [3])])


def test_a_consecutive_range_that_overlaps_a_stored_one_names_the_samples_written_twice():
    w = Warehouse(1 << 30)
    first = [torch.arange(n) for n in range(1, 41)]  # ragged, more than SMALL_RUN: the range paths
    cols, buf = encoded(first)
    w.reserve(buf.size)
    w.store("p", list(range(100, 140)), cols, buf, buf.size)
    # a range that starts before, overlaps, and runs past every index stored so far
    again, buf2 = encoded([torch.zeros(3)] * 60)
    w.reserve(buf2.size)
    with pytest.raises(DockValueError, match=r"samples \[130, 131, 132, 133, 134, 135, 136, 137\]"):
        w.store("p", list(range(130, 190)), again, buf2, buf2.size)
    with pytest.raises(DockValueError, match=r"samples \[100, 101"):
        w.check_absent("p", np.arange(40, 110), ["x"], first=40)
    w.check_absent("p", np.arange(140, 400), ["x"], first=140)  # past the end of what the column has seen
    w.store("p", list(range(140, 200)), again, buf2, buf2.size)
    got = fetched(w, "p", "x", [139, 100, 140, 199])
    assert [t.tolist() for t in got[:2]] == [list(range(40)), [0]] and all(t.tolist() == [0.0] * 3 for t in got[2:])


def _col(name: str, n: int) -> pb.ColumnData:
    return pb.ColumnData(name=name, runs=[pb.Run(kind=pb.MSGPACK, count=n, lengths=[1] * n, nbytes=n)])


@pytest.mark.parametrize(
    "req, match",
    [
        (pb.PutRequest(partition="", columns=[_col("x", 1)], new_count=1), "partition"),
        (pb.PutRequest(partition="p", new_count=1), "at least one column"),
        (pb.PutRequest(partition="p", columns=[_col("x", 1), pb.ColumnData(name="y")], new_count=1), "same positive number"),
        (pb.PutRequest(partition="p", columns=[_col("x", 3)], new_count=3, group_size=2), "multiple of group_size"),
        (pb.PutRequest(partition="p", columns=[_col("x", 2)], indexes=[1]), "1 indexes given for 2"),
    ],
)
def test_put_header_validation(req, match):
    with pytest.raises(DockValueError, match=match):
        runcheck.check_put(req)


def test_a_put_of_existing_samples_in_any_order_is_found_by_index():
    w = Warehouse(1 << 20)
    order = [7, 2, 9, 4, 0]
    cols, buf = encoded([torch.full((k + 1,), i) for k, i in enumerate(order)])  # ragged: the row holds its index
    w.reserve(buf.size)
    w.store("p", order, cols, buf, buf.size)
    got = fetched(w, "p", "x", [0, 2, 4, 7, 9])
    assert [int(t[0]) for t in got] == [0, 2, 4, 7, 9]
    assert [len(t) for t in got] == [5, 2, 4, 1, 3]
    assert [row.tolist() for row in [w.parts["p"].columns["x"].batches[0].rows(np.array([9, 7]))]] == [[2, 0]]


def test_bookkeeping_stays_within_the_memory_budget():
    """10^5 samples x 4 columns of 16 B: the warehouse's bookkeeping stays under 32 B per value and
    the controller's and warehouse's together under 64 B per sample (traced allocations)."""
    import tracemalloc

    from dockd.controller.core import Controller

    n, per = 100_000, 1000
    cols, buf = encoded(torch.zeros(per, 4))
    cols = [type(cols[0])(name=f"c{k}", runs=cols[0].runs) for k in range(4)]
    ctl, w = Controller(), Warehouse(1 << 40)
    tracemalloc.start()
    try:
        t0 = tracemalloc.get_traced_memory()[0]
        puts = [ctl.commit("p", [c.name for c in cols], warehouse=0, new_count=per) for _ in range(n // per)]
        t1 = tracemalloc.get_traced_memory()[0]
        for idx in puts:
            w.reserve(buf.size)
            w.store("p", idx, cols, buf, buf.size)
        t2 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert (t2 - t1) / (4 * n) <= 32, f"{(t2 - t1) / (4 * n):.1f} B per value in the warehouse"
    assert (t2 - t0) / n <= 64, f"{(t2 - t0) / n:.1f} B per sample for controller and warehouse"


def test_device_tier_batches_are_counted_apart_and_freed_with_their_samples():
    """Device-tier runs (a CPU tensor stands in for device memory: the bookkeeping is the same)
    are sliced like host runs, counted in device_used, and released by deletes and free."""
    w = Warehouse(1 << 20, device_capacity=4096)
    host_cols, buf = encoded([1.5, 2.5, 3.5], name="r")
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    own = t.reshape(-1).view(torch.uint8).clone()  # the warehouse's copy of the writer's buffer
    dev_col = pb.ColumnData(name="x")
    dev_col.runs.add(kind=pb.TENSOR, count=3, dtype="float32", shape=[4], nbytes=48, offset=0, device_buffer=1)
    assert w.reserve(buf.size) and w.device_reserve(48)
    assert not w.device_reserve(4096)  # no room left for this one: the daemon spills it
    w.store("p", [0, 1, 2], [*host_cols, dev_col], buf, buf.size, device=[own])
    assert (w.used, w.device_used, w.device_reserved) == (buf.size, 48, 0)
    (_, slices), = w.fetch("p", [("x", [1, 2])])
    (batch, r0, r1), = slices
    assert batch.device is not None and batch.data is None and batch.segment is None
    lo, hi = batch.span(r0, r1)
    got = torch.frombuffer(bytearray(batch.host(lo, hi - lo)), dtype=torch.float32).view(2, 4)
    assert torch.equal(got, t[1:])
    assert w.measure("p", "x", [0, 2]).tolist() == [4.0, 4.0]
    assert w.stats()["device_used"] == 48
    w.free_samples("p", [0, 1])
    assert w.device_used == 48  # a put's memory goes once all its samples are deleted
    w.free_samples("p", [2])
    assert (w.used, w.device_used) == (0, 0)

    assert w.reserve(buf.size) and w.device_reserve(48)
    w.store("q", [0, 1, 2], [*host_cols, dev_col], buf, buf.size, device=[own])
    w.free("q")
    assert (w.used, w.device_used) == (0, 0)
    with pytest.raises(DockValueError, match="device capacity"):
        Warehouse(1 << 20, device_capacity=-1)


def test_deletes_compact_a_put_once_half_of_it_is_deleted():
    """Issue 21: deleting 16 of 32 samples of a put freed nothing (memory went back per whole put)."""
    w = Warehouse(1 << 24)
    dense = [torch.full((1024,), float(i)) for i in range(32)]                       # 4 KiB each
    ragged = [torch.arange(i * 64, dtype=torch.int32) for i in range(32)]           # 0..7.75 KiB
    body = codec.Body()
    cols = codec.encode_columns({"x": dense, "r": ragged, "m": [{"i": i} for i in range(32)]}, body)
    buf = pa.py_buffer(b"".join(bytes(b) for b in body.buffers))
    w.reserve(buf.size)
    w.store("p", list(range(32)), cols, buf, buf.size)
    w.free_samples("p", list(range(0, 32, 4)))  # a quarter: kept as is, counted as reclaimable
    assert w.used == buf.size and w.reclaimable > 0 and w.freed == 0
    kept = [i for i in range(32) if i % 4 == 1]  # then three quarters are gone: compacted
    w.free_samples("p", [i for i in range(32) if i % 4 in (2, 3)])
    assert w.used < buf.size / 3 and w.freed == buf.size - w.used and w.reclaimable == 0
    assert all(torch.equal(a, dense[i]) for a, i in zip(fetched(w, "p", "x", kept), kept))
    assert all(torch.equal(a, ragged[i]) for a, i in zip(fetched(w, "p", "r", kept), kept))
    assert fetched(w, "p", "m", kept) == [{"i": i} for i in kept]
    w.free_samples("p", kept)
    assert (w.used, w.reclaimable, w.freed, w.meta) == (0, 0, buf.size, 0)


def test_small_reads_find_the_same_slices_as_array_reads():
    """Reads of a few samples take a scalar path: same slices as the array path, for puts of
    consecutive samples, of samples in any order, and across puts; a missing one is named."""
    w = Warehouse(1 << 30)
    for idx in ([0, 1, 2, 3], [9, 5, 7], [4]):  # (the second put's rows are looked up by key)
        cols, buf = encoded([torch.full((2,), i) for i in idx])
        w.reserve(buf.size)
        w.store("p", idx, cols, buf, buf.size)
    for want in ([1], [1, 2], [3, 4, 5], [7, 5, 9], [9, 0, 4, 2, 3, 7, 5, 1]):
        small = w.fetch("p", [("x", want)])[0][1]
        array = w.fetch("p", [("x", np.asarray(want))])[0][1]
        assert [(id(b), r0, r1) for b, r0, r1 in small] == [(id(b), r0, r1) for b, r0, r1 in array]
        assert [int(v[0]) for v in fetched(w, "p", "x", want)] == want
    for missing in ([6], [1, 8], [-1], [1 << 40]):
        with pytest.raises(DockNotFound, match="not in this warehouse"):
            w.fetch("p", [("x", missing)])


def test_a_read_across_many_puts_of_a_few_samples_finds_every_value_in_order():
    """A get of samples put one or two at a time (async RL) spans many puts: it takes the scalar
    path, one step per sample, where the array path took one step per put; the slices are the same
    as the array path's: consecutive rows of one put merged, in the order asked."""
    w = Warehouse(1 << 30)
    puts = [[i] for i in range(24)] + [[24, 25], [27, 26], [28, 29, 30, 31], list(range(32, 40))]
    for idx in puts:
        cols, buf = encoded([torch.full((3,), i) for i in idx])
        w.reserve(buf.size)
        w.store("p", idx, cols, buf, buf.size)
    col = w.parts["p"].columns["x"]
    rng = np.random.default_rng(0)
    for want in (list(range(32)), [24, 25, 26, 27, 3, 2, 1], rng.permutation(40).tolist(), [28, 29, 30, 31, 0, 1],
                 list(range(28, 40)), [39, 38, 31, 30, 37, 36, 35, 34, 33, 32]):  # (the last two: few puts, array path)
        got = col.slices(np.asarray(want))
        each = col.slices_small(want)
        assert [(id(b), r0, r1) for b, r0, r1 in got] == [(id(b), r0, r1) for b, r0, r1 in each]
        assert [int(v[0]) for v in fetched(w, "p", "x", np.asarray(want))] == want
    assert len(col.slices(np.arange(24, 32))) == 4  # (three puts; [27, 26] stored in that order: two slices)


def test_a_read_of_a_range_of_indexes_finds_the_same_slices_as_the_general_path():
    """A read of consecutive indexes takes a shortcut when one put holds them all in row order; where it
    does not (the range crosses puts, a put in any order, a sample deleted) the general path answers: the
    slices are those of `_Column.slices`, and a missing sample is named."""
    w = Warehouse(1 << 30)
    for idx in ([*range(0, 40), *range(42, 50)], [40, 41], list(range(50, 64)), list(range(64, 128)),
                [135, 128, 129, 130, 131, 132, 133, 134], list(range(136, 200))):
        cols, buf = encoded([torch.full((3,), i) for i in idx])
        w.reserve(buf.size)
        w.store("p", idx, cols, buf, buf.size)
    w.free_samples("p", [150])
    col = w.parts["p"].columns["x"]
    for first, n in ((0, 64), (3, 20), (0, 40), (42, 22), (30, 20), (60, 10), (64, 64), (128, 8), (129, 4),
                     (190, 10), (136, 14), (0, 1), (63, 2), (55, 70), (50, 78), (40, 88)):
        want = np.arange(first, first + n)
        got = w.fetch("p", [("x", want)])[0][1]
        assert [(id(b), r0, r1) for b, r0, r1 in got] == [(id(b), r0, r1) for b, r0, r1 in col.slices(want)]
        values = [int(v[0]) for v in fetched(w, "p", "x", want)]
        assert values == list(range(first, first + n))
    assert col.range_slices(0, 64) is None and col.range_slices(128, 8) is None  # (general path: in any order)
    assert len(col.range_slices(64, 64)) == 1 and len(col.range_slices(40, 2)) == 1
    assert [s[1:] for s in col.range_slices(55, 70)] == [(5, 14), (0, 61)]  # (two puts: 50.. and 64..)
    for first, n in ((140, 20), (150, 1), (195, 10), (-1, 3)):
        with pytest.raises(DockNotFound, match="not in this warehouse"):
            w.fetch("p", [("x", np.arange(first, first + n))])
