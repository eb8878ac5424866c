"""dockd.net.device_share without an accelerator: which devices go through the device tier, how
NPU devices are named across processes with different visible-device lists, and the errors a
process gets for device memory it cannot map."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dockd._proto import dockd_pb2 as pb
from dockd.errors import DockValueError
from dockd.net import device_share


def test_accelerators_are_tiered_and_cpu_only_as_the_stand_in(monkeypatch):
    monkeypatch.delenv("DOCKD_CPU_DEVICE_TIER", raising=False)
    assert device_share.tiered("cuda") and device_share.tiered("npu")
    assert not device_share.tiered("cpu") and not device_share.tiered("meta")
    monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "1")
    assert device_share.tiered("cpu")
    monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "0")
    assert not device_share.tiered("cpu")


@pytest.mark.parametrize("visible, index, physical", [
    ("", 0, 0), ("", 5, 5),                 # unset: a process numbers NPUs as the machine does
    ("4,5,6,7", 0, 4), ("4,5,6,7", 3, 7),
    ("3, 1", 1, 1),                         # in the order given, spaces allowed
])
def test_npu_indexes_map_to_physical_ids_through_the_visible_list(visible, index, physical):
    assert device_share.physical_npu(index, visible) == physical


def test_two_processes_with_different_visible_lists_name_the_same_npu_alike(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    writer = device_share.device_uuid("npu", 1)  # its NPU 1 is physical NPU 3
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    assert device_share.device_uuid("npu", 0) == writer == "npu-3"


@pytest.mark.parametrize("visible, index", [("4,5", 2), ("a,b", 0), ("4,5", -1)])
def test_an_npu_outside_the_visible_list_is_a_clear_error(visible, index):
    with pytest.raises(DockValueError, match="is not in ASCEND_RT_VISIBLE_DEVICES"):
        device_share.physical_npu(index, visible)


def test_host_tensors_keep_their_layout():
    t = torch.arange(6).reshape(2, 3)
    assert device_share.base_layout(t) is t


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_buffers_in_a_process_without_torch_npu_say_what_is_missing():
    desc = pb.DeviceBuffer(type="npu", handle=b"h" * 65, storage_size=64, nbytes=64, uuid="npu-0")
    with pytest.raises(DockValueError, match="need torch_npu 7.2 or newer"):
        device_share.open_buffer(desc)


def test_bad_buffers_are_refused_before_anything_is_mapped(monkeypatch):
    monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "1")
    with pytest.raises(DockValueError, match="64 bytes in a storage of 16"):
        device_share.open_buffer(pb.DeviceBuffer(type="cpu", storage_size=16, nbytes=64))
    with pytest.raises(DockValueError, match="unknown device buffer type 'xpu'"):
        device_share.open_buffer(pb.DeviceBuffer(type="xpu", storage_size=16, nbytes=16))
    with pytest.raises(DockValueError, match="cannot be shared through the device tier"):
        device_share.export(torch.empty(4, device="meta"))


def test_a_cpu_stand_in_buffer_round_trips_through_export_and_open(monkeypatch):
    monkeypatch.setenv("DOCKD_CPU_DEVICE_TIER", "1")
    t = torch.arange(32, dtype=torch.int32)[8:]
    desc, base = device_share.export(t)
    assert desc.type == "cpu" and base == 32 and desc.nbytes == 128
    got = device_share.open_buffer(desc)
    assert torch.equal(got[base:].view(torch.int32), t)
