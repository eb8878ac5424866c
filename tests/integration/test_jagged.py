"""Jagged columns and TensorDicts through real daemons: a jagged nested tensor (or a Jagged pair) is put as
one ragged run and got back as one (`batch.jagged`), a view of the mapped segment on the same host where
it came as one run; a TensorDict goes in with `put` and comes back with `batch.to_tensordict()`."""

from __future__ import annotations

import warnings

import pytest
import torch

import dockd
from dockd.net import same_host

tensordict = pytest.importorskip("tensordict")
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def mapped_store_ranges() -> list[tuple[int, int]]:
    """The address ranges of warehouse segments mapped into this process (zero-copy results)."""
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if "memfd:dockd-store" in line]


def in_a_segment(t: torch.Tensor) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in mapped_store_ranges())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_jagged_columns_and_tensordicts_round_trip_bit_exact(cluster, partition, monkeypatch, transport):
    if transport == "tcp":
        monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")
    lengths = [3, 0, 7, 1]
    pairs = [(torch.randn(n, 2) * 10).to(torch.bfloat16) for n in lengths]  # (L_i, 2) bf16, an empty row
    nested = torch.nested.as_nested_tensor(pairs, layout=torch.jagged)
    ids = torch.arange(11, dtype=torch.int64)
    with dockd.connect(cluster.address, warehouse=1) as d:
        d.put({"pairs": nested, "ids": dockd.Jagged(ids, torch.tensor([0, 3, 3, 10, 11])), "uid": list("abcd")},
              partition=partition)
        b = d.get("c", ["pairs", "ids", "uid"], 4, partition=partition, timeout=10)
        got = b.jagged("pairs")
        assert got.layout == torch.jagged and got.offsets().tolist() == [0, 3, 3, 10, 11]
        assert all(torch.equal(bits(a), bits(e)) for a, e in zip(got.unbind(), pairs, strict=True))
        assert [t.tolist() for t in b.jagged("ids").unbind()] == [[0, 1, 2], [], [3, 4, 5, 6, 7, 8, 9], [10]]
        padded, lens = b.padded("ids", pad_value=-1)
        assert lens.tolist() == lengths and padded[1].tolist() == [-1] * 7 and padded[3].tolist() == [10] + [-1] * 6

        td = b.to_tensordict()
        assert td.batch_size == torch.Size([4]) and td.get("uid").tolist() == list("abcd")
        assert td.get("pairs").layout == torch.jagged
        d.put(td, partition=partition + "-td")  # and back in, as it came out
        again = d.get("c", ["pairs", "ids", "uid"], 4, partition=partition + "-td", timeout=10)
        assert torch.equal(bits(again.jagged("pairs").values()), bits(nested.values()))
        assert torch.equal(again.jagged("ids").values(), ids) and again["uid"] == list("abcd")
        d.clear(partition)
        d.clear(partition + "-td")


def test_a_tensordict_with_tensor_jagged_and_non_tensor_fields_goes_in_and_comes_back_in_index_order(dock, partition):
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    td = TensorDict({"obs": torch.arange(12.0).view(4, 3),
                     "tokens": torch.nested.as_nested_tensor([torch.arange(n) for n in (2, 5, 0, 1)], layout=torch.jagged),
                     "meta": NonTensorStack(*[NonTensorData(v) for v in ({"i": 0}, "x", None, [1, 2])])}, batch_size=[4])
    td.set_non_tensor("run", "grpo-7")  # one value for every row
    idx = dock.put(td, partition=partition)
    b = dock.get("c", ["obs", "tokens", "meta", "run"], 4, partition=partition, shuffle=True, seed=3, timeout=10)
    out = b.to_tensordict()
    order = [idx.index(i) for i in b.indexes]
    assert torch.equal(out.get("obs"), td.get("obs")[order])
    assert [t.tolist() for t in out.get("tokens").unbind()] == [td.get("tokens").unbind()[k].tolist() for k in order]
    assert out.get("meta").tolist() == [td.get("meta").tolist()[k] for k in order]
    assert b["run"] == ["grpo-7"] * 4
    with pytest.raises(dockd.DockValueError, match=r"batch_size \[n\]"):
        dock.put(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]), partition=partition)
    with pytest.raises(dockd.DockTypeError, match="flatten_keys"):
        dock.put(TensorDict({"a": TensorDict({"b": torch.zeros(2)}, batch_size=[2])}, batch_size=[2]), partition=partition)
    dock.clear(partition)


def test_jagged_columns_of_equal_lengths_come_back_combinable_as_rl_code_combines_them(dock, partition):
    """log_probs - ref_log_probs, masked by the response mask: torch combines jagged nested tensors only over
    one offsets tensor, so the columns of a batch with the same lengths share theirs (in the TensorDict too)."""
    lens = (3, 1, 4, 2)
    cols = {name: torch.nested.as_nested_tensor([torch.randn(n) for n in lens], layout=torch.jagged)
            for name in ("log_probs", "ref_log_probs")}
    cols["mask"] = torch.nested.as_nested_tensor([torch.ones(n) for n in lens], layout=torch.jagged)
    cols["prompt"] = torch.nested.as_nested_tensor([torch.arange(n) for n in (5, 5, 2, 7)], layout=torch.jagged)
    dock.put(cols, partition=partition)
    b = dock.get("c", list(cols), 4, partition=partition, timeout=10)
    kl = (b.jagged("log_probs") - b.jagged("ref_log_probs")) * b.jagged("mask")
    want = [(x - y).tolist() for x, y in zip(b["log_probs"], b["ref_log_probs"])]
    assert [t.tolist() for t in kl.unbind()] == want
    assert b.packed("log_probs").offsets is b.packed("mask").offsets
    assert b.packed("prompt").offsets is not b.packed("mask").offsets  # (other lengths: offsets of their own)
    td = b.to_tensordict()
    assert [t.tolist() for t in (td["log_probs"] - td["ref_log_probs"]).unbind()] == want
    dock.clear(partition)


@pytest.mark.skipif(not same_host.available(), reason="needs Linux memfd and SCM_RIGHTS")
def test_a_jagged_get_of_one_run_is_a_view_of_the_mapped_segment_and_of_several_a_copy(cluster, partition):
    rows = [torch.randint(0, 1 << 30, (n,), dtype=torch.int64) for n in (40_000, 0, 90_000, 30_000)]  # ~1.3 MB
    with dockd.connect(cluster.address, warehouse=0) as d:
        d.put({"x": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, partition=partition)
        one = d.get("c", ["x"], 4, partition=partition, timeout=10).jagged("x")
        assert in_a_segment(one.values())  # one put, one run: the values are the segment's bytes
        assert all(torch.equal(a, e) for a, e in zip(one.unbind(), rows))
        one.values()[:5] = -1  # a private mapping: writing copies the pages written, the stored bytes stay
        again = d.get("c2", ["x"], 4, partition=partition, timeout=10).jagged("x")
        assert torch.equal(again.values(), torch.cat(rows))

        d.put({"x": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, partition=partition)
        two = d.get("c", ["x"], 4, partition=partition, timeout=10)  # the second put
        d.put({"x": torch.nested.as_nested_tensor(rows[:2], layout=torch.jagged)}, partition=partition + "-b")
        d.put({"x": torch.nested.as_nested_tensor(rows[2:], layout=torch.jagged)}, partition=partition + "-b")
        both = d.get("c", ["x"], 4, partition=partition + "-b", timeout=10).jagged("x")  # two puts' runs: joined
        assert not in_a_segment(both.values())
        assert both.offsets().tolist() == [0, 40_000, 40_000, 130_000, 160_000]
        assert torch.equal(both.values(), torch.cat(rows)) and torch.equal(two.jagged("x").values(), torch.cat(rows))
        d.clear(partition)
        d.clear(partition + "-b")


def test_a_jagged_get_served_from_leases_taken_ahead_is_a_view_of_the_mapped_segment(cluster, partition):
    """get(prefetch=n): the one acquire's inline columns are cut into each get's samples as they came, so
    each get's jagged column is a view of the mapped segment (they were decoded into per-sample tensors,
    then joined by a copy), and its other columns are its own samples' values."""
    rows = [torch.randint(0, 1 << 30, (n,), dtype=torch.int64) for n in (40_000, 7, 90_000, 30_000, 0, 20_000, 5, 60_000)]
    with dockd.connect(cluster.address, warehouse=0) as d:  # (the controller's warehouse: values come inline)
        d.put({"x": torch.nested.as_nested_tensor(rows, layout=torch.jagged), "uid": [f"s{i}" for i in range(8)]},
              partition=partition)
        for k in range(4):  # one acquire of 8, four gets of 2
            b = d.get("c", ["x", "uid"], 2, partition=partition, timeout=10, prefetch=4)
            assert b.indexes == [2 * k, 2 * k + 1] and b["uid"] == [f"s{2 * k}", f"s{2 * k + 1}"]
            got = b.jagged("x")
            assert in_a_segment(got.values())
            assert got.offsets().tolist() == [0, len(rows[2 * k]), len(rows[2 * k]) + len(rows[2 * k + 1])]
            pair = b.packed("x")  # (the same column as a Jagged pair: the same view, the same offsets)
            assert pair.values.data_ptr() == got.values().data_ptr() and torch.equal(pair.offsets, got.offsets())
            assert all(torch.equal(a, e) for a, e in zip(got.unbind(), rows[2 * k: 2 * k + 2], strict=True))
        d.clear(partition)
