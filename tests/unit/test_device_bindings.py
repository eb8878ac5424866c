"""dockd.device against the real libnccl.so.2 of the nvidia-nccl-cu13 wheel, no GPU needed.

Calls into the library run in a child process (one, shared by the tests that need it),
so that a misbehaving library cannot take the test interpreter down or hang it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from dockd.device import (
    HCCL_ROOT_INFO_BYTES,
    NCCL_UNIQUE_ID_BYTES,
    Communicator,
    DeviceArgumentError,
    DeviceDTypeError,
    DeviceLibraryNotFound,
    DockDeviceError,
    HcclRootInfo,
    NcclError,
    NcclUniqueId,
    backend_for_device,
    discovery,
    hccl_dtype,
    load_hccl_library,
    load_nccl_library,
    nccl_dtype,
)
from dockd.errors import DockError


def _nccl_path() -> str | None:
    try:
        return load_nccl_library()[1]   # dlopen only: no NCCL call is made
    except DeviceLibraryNotFound:
        return None


NCCL_PATH = _nccl_path()
needs_nccl = pytest.mark.skipif(NCCL_PATH is None, reason="libnccl.so.2 not found: pip install nvidia-nccl-cu13 "
                                                           "(the dev extra does), or set DOCKD_NCCL_LIB")


def _wheel_version() -> str | None:
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_PROBE = r"""
import ctypes, json, sys
from dockd.device import Communicator, NcclError, NcclLibrary
from dockd.device.nccl import RESULT_NAMES
lib = NcclLibrary(sys.argv[1])
raw = ctypes.CDLL(sys.argv[1])
raw.ncclGetErrorString.restype = ctypes.c_char_p
raw.ncclGetErrorString.argtypes = [ctypes.c_int]
out = {"path": lib.path, "version": lib.version()}
out["uids"] = [lib.get_unique_id().hex() for _ in range(2)]
out["strings"] = {c: lib.error_string(c) for c in range(9)}
out["raw_strings"] = {c: raw.ncclGetErrorString(c).decode() for c in range(9)}
comm = Communicator("nccl", library_path=sys.argv[1])
try:
    comm.init(comm.unique_id(), 0, 1)   # no usable GPU (CUDA_VISIBLE_DEVICES is empty): must fail
    out["init"] = "succeeded"
except NcclError as e:
    out["init"] = {"code": e.code, "code_name": e.code_name, "library_message": e.library_message,
                   "last_error": e.last_error, "function": e.function, "str": str(e),
                   "known_name": RESULT_NAMES.get(e.code)}
import torch
from dockd.net.device_link import Link
out["link_rendezvous"] = len(Link.offer("nccl", torch.device("cuda", 0), "127.0.0.1").rendezvous)
print("PROBE" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NCCL_DEBUG="")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_PROBE), NCCL_PATH],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, f"probe failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE")][-1]
    return json.loads(line[len("PROBE"):])


# --- the library, called for real (in the child) -------------------------------------------------------
@needs_nccl
def test_version_matches_the_wheel(probe):
    v = probe["version"]
    major, minor, patch = v // 10000, v // 100 % 100, v % 100
    assert major == 2 and minor >= 7, v
    wheel = _wheel_version()
    wheel_dir = os.path.join("nvidia", "nccl", "lib")
    if wheel is None or wheel_dir not in probe["path"]:
        pytest.skip(f"library {probe['path']} is not from an nvidia-nccl wheel; version {v}")
    w = [int(x) for x in wheel.split(".")[:3]]
    assert (major, minor, patch) == tuple(w), (v, wheel)
    assert v == w[0] * 10000 + w[1] * 100 + w[2]


@needs_nccl
def test_unique_ids_are_128_fresh_bytes(probe):
    a, b = (bytes.fromhex(u) for u in probe["uids"])
    assert len(a) == len(b) == NCCL_UNIQUE_ID_BYTES == 128
    assert a != b
    assert any(a)


@needs_nccl
def test_a_device_links_rendezvous_is_an_nccl_unique_id(probe):
    """A reader's end of a cross-node device link: made without a GPU, as the bindings' unique id."""
    assert probe["link_rendezvous"] == 128


@needs_nccl
def test_error_strings_are_the_librarys_own(probe):
    strings = {int(k): v for k, v in probe["strings"].items()}
    raw = {int(k): v for k, v in probe["raw_strings"].items()}
    assert strings == raw
    assert strings[0] == "no error"
    assert "invalid argument" in strings[4]
    assert "invalid usage" in strings[5]
    assert all(strings[c] for c in range(8))
    assert len({strings[c] for c in range(8)}) == 8


@needs_nccl
def test_failing_call_raises_with_the_librarys_message(probe):
    init = probe["init"]
    assert isinstance(init, dict), "ncclCommInitRank succeeded without a visible GPU"
    assert init["function"] == "ncclCommInitRank"
    assert init["code"] != 0 and init["code_name"] == init["known_name"]
    assert init["library_message"] == probe["strings"][str(init["code"])]
    assert init["library_message"] in init["str"] and init["code_name"] in init["str"]
    if init["last_error"]:   # ncclGetLastError (NCCL >= 2.13) adds the specific cause
        assert init["last_error"] in init["str"]


# --- errors and discovery ------------------------------------------------------------------------------
def test_errors_are_dock_errors():
    e = NcclError(backend="nccl", function="ncclSend", code=4, code_name="ncclInvalidArgument",
                  library_message="invalid argument", last_error="count is 0")
    assert isinstance(e, DockDeviceError) and isinstance(e, DockError)
    assert str(e) == "ncclSend failed: ncclInvalidArgument (4): invalid argument; last error: count is 0"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is NcclError and str(back) == str(e) and back.code == 4
    assert issubclass(DeviceDTypeError, TypeError) and issubclass(DeviceArgumentError, ValueError)
    assert issubclass(DeviceLibraryNotFound, DockDeviceError)


def test_env_pointing_at_a_missing_file(monkeypatch, tmp_path):
    missing = str(tmp_path / "nope" / "libnccl.so.2")
    monkeypatch.setenv("DOCKD_NCCL_LIB", missing)
    with pytest.raises(DeviceLibraryNotFound) as ei:
        load_nccl_library()
    msg = str(ei.value)
    assert missing in msg and "DOCKD_NCCL_LIB" in msg and "does not exist" in msg
    assert "pip install nvidia-nccl-cu13" in msg


def test_explicit_path_comes_before_the_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKD_NCCL_LIB", str(tmp_path / "env-lib.so"))
    with pytest.raises(DeviceLibraryNotFound, match="path argument points to .*arg-lib.so"):
        load_nccl_library(str(tmp_path / "arg-lib.so"))


def test_a_file_that_is_not_a_library(monkeypatch, tmp_path):
    fake = tmp_path / "libnccl.so.2"
    fake.write_text("not an ELF file")
    monkeypatch.setenv("DOCKD_NCCL_LIB", str(fake))
    with pytest.raises(DeviceLibraryNotFound, match="cannot be loaded"):
        load_nccl_library()


def test_nothing_found_lists_what_was_searched(monkeypatch, tmp_path):
    monkeypatch.delenv("DOCKD_NCCL_LIB", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    monkeypatch.setattr(discovery, "_wheel_nccl_candidates", lambda: [str(tmp_path / "wheel" / "libnccl.so.2")])
    monkeypatch.setattr(discovery.ctypes.util, "find_library", lambda name: None)

    def no_dlopen(path):
        raise OSError(f"{path}: cannot open shared object file")

    monkeypatch.setattr(discovery, "_dlopen", no_dlopen)
    with pytest.raises(DeviceLibraryNotFound) as ei:
        load_nccl_library()
    msg, searched = str(ei.value), ei.value.searched
    assert "nvidia-nccl wheel" in searched[0] and "LD_LIBRARY_PATH" in searched[1]
    assert str(tmp_path) in msg and "find_library" in msg and "dlopen('libnccl.so.2')" in msg
    assert "pip install nvidia-nccl-cu13" in msg and "DOCKD_NCCL_LIB" in msg


def test_missing_hccl_names_ascend_home_path(monkeypatch, tmp_path):
    import ctypes.util

    if ctypes.util.find_library("hccl") or os.path.exists(os.path.join(discovery.ASCEND_DEFAULT, "lib64")):
        pytest.skip("this machine has an Ascend toolkit")
    monkeypatch.delenv("DOCKD_HCCL_LIB", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    with pytest.raises(DeviceLibraryNotFound) as ei:
        load_hccl_library()
    msg = str(ei.value)
    assert "libhccl.so not found" in msg
    assert f"ASCEND_HOME_PATH: {tmp_path}/lib64/libhccl.so" in msg
    assert "ASCEND_TOOLKIT_HOME: (not set)" in msg and "DOCKD_HCCL_LIB" in msg
    with pytest.raises(DeviceLibraryNotFound, match="ASCEND_HOME_PATH"):
        Communicator("hccl")


# --- structs and dtypes --------------------------------------------------------------------------------
def test_struct_sizes():
    assert ctypes.sizeof(NcclUniqueId) == NCCL_UNIQUE_ID_BYTES == 128
    assert ctypes.sizeof(HcclRootInfo) == HCCL_ROOT_INFO_BYTES == 4108


NCCL_CODES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
              torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
HCCL_CODES = {torch.int8: 0, torch.int32: 2, torch.float16: 3, torch.float32: 4, torch.int64: 5,
              torch.uint8: 7, torch.float64: 10, torch.bfloat16: 11}


@pytest.mark.parametrize("dtype", list(NCCL_CODES))
def test_dtype_codes(dtype):
    assert nccl_dtype(dtype) == NCCL_CODES[dtype]
    assert hccl_dtype(dtype) == HCCL_CODES[dtype]


def test_dtypes_without_a_code_are_refused():
    for bad in (torch.complex64, torch.int16, "float32", None):
        with pytest.raises(DeviceDTypeError, match="NCCL has no data type for .*supported: bfloat16"):
            nccl_dtype(bad)
    for bad in (torch.complex64, torch.float8_e4m3fn, None):
        with pytest.raises(DeviceDTypeError, match="HCCL has no data type for"):
            hccl_dtype(bad)
    assert hccl_dtype(torch.int16) == 1 and nccl_dtype(torch.bool) == 1 and hccl_dtype(torch.bool) == 7


# --- the Communicator's checks (before any library call) -----------------------------------------------
def test_backend_choice():
    assert backend_for_device(torch.device("cuda", 1)) == "nccl"
    assert backend_for_device("npu:0") == "hccl"
    with pytest.raises(DeviceArgumentError, match="no collective backend for device type 'cpu'"):
        backend_for_device(torch.device("cpu"))
    with pytest.raises(DeviceArgumentError, match="unknown collective backend 'mpi'"):
        Communicator("mpi")


@needs_nccl
def test_communicator_checks_arguments():
    comm = Communicator("nccl")
    assert not comm.initialized
    with pytest.raises(DeviceArgumentError, match="not in"):
        comm.init(b"\0" * 128, 1, 1)
    with pytest.raises(DeviceArgumentError, match="is on cpu; nccl moves cuda tensors only"):
        comm.send(torch.zeros(4), 1)
    with pytest.raises(DeviceArgumentError, match="not initialised"):
        _ = comm.handle
    with pytest.raises(DeviceArgumentError, match="128 bytes, got 3"):
        comm.lib.comm_init_rank(b"abc", 0, 1)
    comm.destroy()   # a no-op before init
