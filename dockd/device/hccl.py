"""ctypes bindings of HCCL (libhccl.so, Ascend CANN), the NPU twin of `nccl.py`.

Signatures and enum values follow CANN's public headers inc/hccl/hccl.h and
inc/hccl/hccl_types.h (as published in the CANN hcomm sources); they were read,
not run: no Ascend machine was available when this was written.
"""

from __future__ import annotations

import ctypes

from dockd.device import _torch_dtypes
from dockd.device.discovery import bind, load_hccl_library
from dockd.device.errors import DeviceArgumentError, DeviceDTypeError, HcclError

HCCL_ROOT_INFO_BYTES = 4108   # hccl_types.h: const uint32_t HCCL_ROOT_INFO_BYTES = 4108


class HcclRootInfo(ctypes.Structure):
    """typedef struct HcclRootInfoDef { char internal[HCCL_ROOT_INFO_BYTES]; } HcclRootInfo;"""

    _fields_ = [("internal", ctypes.c_char * HCCL_ROOT_INFO_BYTES)]


HcclComm = ctypes.c_void_p
aclrtStream = ctypes.c_void_p
HcclResult = ctypes.c_int      # C enum: int-sized
HcclDataType = ctypes.c_int    # C enum: int-sized

# HcclResult (hccl_types.h)
RESULT_NAMES = {
    0: "HCCL_SUCCESS", 1: "HCCL_E_PARA", 2: "HCCL_E_PTR", 3: "HCCL_E_MEMORY", 4: "HCCL_E_INTERNAL",
    5: "HCCL_E_NOT_SUPPORT", 6: "HCCL_E_NOT_FOUND", 7: "HCCL_E_UNAVAIL", 8: "HCCL_E_SYSCALL",
    9: "HCCL_E_TIMEOUT", 10: "HCCL_E_OPEN_FILE_FAILURE", 11: "HCCL_E_TCP_CONNECT", 12: "HCCL_E_ROCE_CONNECT",
    13: "HCCL_E_TCP_TRANSFER", 14: "HCCL_E_ROCE_TRANSFER", 15: "HCCL_E_RUNTIME", 16: "HCCL_E_DRV",
    17: "HCCL_E_PROFILING", 18: "HCCL_E_CCE", 19: "HCCL_E_NETWORK", 20: "HCCL_E_AGAIN", 21: "HCCL_E_REMOTE",
    22: "HCCL_E_SUSPENDING", 23: "HCCL_E_OPRETRY_FAIL", 24: "HCCL_E_OOM", 1041: "HCCL_E_IN_STATUS",
}
# the headers' one-line comments, used when the library has no HcclGetErrorString (older CANN)
_RESULT_TEXT = {
    0: "success", 1: "parameter error", 2: "empty pointer", 3: "memory error", 4: "internal error",
    5: "not support feature", 6: "not found specific resource", 7: "resource unavailable",
    8: "call system interface error", 9: "timeout", 10: "open file fail", 11: "tcp connect fail",
    12: "roce connect fail", 13: "tcp transfer fail", 14: "roce transfer fail", 15: "call runtime api fail",
    16: "call driver api fail", 17: "call profiling api fail", 18: "call cce api fail",
    19: "call network api fail", 20: "try again", 21: "error cqe", 22: "error communicator suspending",
    23: "retry constraint", 24: "out of memory", 1041: "the error information is in the status",
}

# HcclDataType (hccl_types.h)
HCCL_DATA_TYPE_INT8, HCCL_DATA_TYPE_INT16, HCCL_DATA_TYPE_INT32, HCCL_DATA_TYPE_FP16 = 0, 1, 2, 3
HCCL_DATA_TYPE_FP32, HCCL_DATA_TYPE_INT64, HCCL_DATA_TYPE_UINT64, HCCL_DATA_TYPE_UINT8 = 4, 5, 6, 7
HCCL_DATA_TYPE_UINT16, HCCL_DATA_TYPE_UINT32, HCCL_DATA_TYPE_FP64, HCCL_DATA_TYPE_BFP16 = 8, 9, 10, 11
# Not mapped: INT128 = 12, and HIF8 = 14, FP8E4M3 = 15, FP8E5M2 = 16, FP8E8M0 = 17, which the
# header marks "experimental"; fp8 tensors are refused on HCCL until that changes.

# torch dtype -> HcclDataType; bool travels as uint8 (same size, data movement only).
DTYPES = _torch_dtypes.table([
    ("int8", HCCL_DATA_TYPE_INT8), ("int16", HCCL_DATA_TYPE_INT16), ("int32", HCCL_DATA_TYPE_INT32),
    ("int64", HCCL_DATA_TYPE_INT64), ("uint8", HCCL_DATA_TYPE_UINT8), ("bool", HCCL_DATA_TYPE_UINT8),
    ("uint16", HCCL_DATA_TYPE_UINT16), ("uint32", HCCL_DATA_TYPE_UINT32), ("uint64", HCCL_DATA_TYPE_UINT64),
    ("float16", HCCL_DATA_TYPE_FP16), ("float32", HCCL_DATA_TYPE_FP32), ("float64", HCCL_DATA_TYPE_FP64),
    ("bfloat16", HCCL_DATA_TYPE_BFP16),
])


def hccl_dtype(dtype) -> int:
    """The HcclDataType code for a torch dtype; DeviceDTypeError for one HCCL cannot carry."""
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in DTYPES))
        raise DeviceDTypeError(f"HCCL has no data type for {dtype}; supported: {names}") from None


_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64
# (name, restype, argtypes, required)
_SIGNATURES = [
    ("HcclGetRootInfo", HcclResult, [ctypes.POINTER(HcclRootInfo)], True),
    # HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm)
    ("HcclCommInitRootInfo", HcclResult, [_u32, ctypes.POINTER(HcclRootInfo), _u32, ctypes.POINTER(HcclComm)], True),
    ("HcclCommDestroy", HcclResult, [HcclComm], True),
    # HcclSend(void* sendBuf, uint64_t count, HcclDataType, uint32_t destRank, HcclComm, aclrtStream)
    ("HcclSend", HcclResult, [ctypes.c_void_p, _u64, HcclDataType, _u32, HcclComm, aclrtStream], True),
    ("HcclRecv", HcclResult, [ctypes.c_void_p, _u64, HcclDataType, _u32, HcclComm, aclrtStream], True),
    # HcclBroadcast(void *buf, uint64_t count, HcclDataType, uint32_t root, HcclComm, aclrtStream)
    ("HcclBroadcast", HcclResult, [ctypes.c_void_p, _u64, HcclDataType, _u32, HcclComm, aclrtStream], True),
    # HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType, HcclComm, aclrtStream)
    ("HcclAllGather", HcclResult, [ctypes.c_void_p, ctypes.c_void_p, _u64, HcclDataType, HcclComm, aclrtStream],
     True),
    ("HcclGetErrorString", ctypes.c_char_p, [HcclResult], False),   # const char *HcclGetErrorString(HcclResult)
    ("HcclGroupStart", HcclResult, [], False),                       # newer CANN only
    ("HcclGroupEnd", HcclResult, [], False),
]


class HcclLibrary:
    """The HCCL C API through ctypes, the same shape as `NcclLibrary`, raising HcclError on failure."""

    name = "hccl"
    device_type = "npu"
    unique_id_bytes = HCCL_ROOT_INFO_BYTES

    def __init__(self, path: str | None = None) -> None:
        self.lib, self.path = load_hccl_library(path)
        self._fn = bind(self.lib, self.path, _SIGNATURES, "not an HCCL library, or one too old")

    def has(self, fname: str) -> bool:
        return fname in self._fn

    def error_string(self, code: int) -> str:
        f = self._fn.get("HcclGetErrorString")
        if f is not None:
            s = f(code)
            if s:
                return s.decode(errors="replace")
        return _RESULT_TEXT.get(code, "unknown result code")

    def last_error(self, comm: int | None = None) -> str:
        return ""   # HCCL has no public last-error call; details go to the CANN plog

    def check(self, fname: str, code: int, comm: int | None = None) -> None:
        if code != 0:
            raise HcclError(backend="hccl", function=fname, code=code,
                            code_name=RESULT_NAMES.get(code, f"HcclResult({code})"),
                            library_message=self.error_string(code), last_error=self.last_error(comm))

    def _call(self, fname: str, *args) -> None:
        self.check(fname, self._fn[fname](*args))

    def version(self) -> int:
        raise DeviceArgumentError("HCCL exposes no version call; read it from the CANN toolkit "
                                  "($ASCEND_HOME_PATH/version.cfg or ascend_toolkit_install.info)")

    def get_unique_id(self) -> bytes:
        info = HcclRootInfo()
        self._call("HcclGetRootInfo", ctypes.byref(info))
        return ctypes.string_at(ctypes.addressof(info), HCCL_ROOT_INFO_BYTES)

    def comm_init_rank(self, unique_id: bytes, rank: int, nranks: int) -> int:
        if len(unique_id) != HCCL_ROOT_INFO_BYTES:
            raise DeviceArgumentError(f"an HCCL root info is {HCCL_ROOT_INFO_BYTES} bytes, got {len(unique_id)}")
        info = HcclRootInfo.from_buffer_copy(unique_id)
        comm = HcclComm()
        self._call("HcclCommInitRootInfo", nranks, ctypes.byref(info), rank, ctypes.byref(comm))
        assert comm.value is not None, "HcclCommInitRootInfo succeeded without writing a communicator"
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self._call("HcclCommDestroy", comm)

    comm_abort = comm_destroy   # HCCL has no abort in the public API

    def send(self, ptr: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._call("HcclSend", ptr, count, dtype, peer, comm, stream)

    def recv(self, ptr: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._call("HcclRecv", ptr, count, dtype, peer, comm, stream)

    def broadcast(self, ptr: int, count: int, dtype: int, root: int, comm: int, stream: int) -> None:
        self._call("HcclBroadcast", ptr, count, dtype, root, comm, stream)

    def all_gather(self, send_ptr: int, recv_ptr: int, send_count: int, dtype: int, comm: int,
                   stream: int) -> None:
        self._call("HcclAllGather", send_ptr, recv_ptr, send_count, dtype, comm, stream)

    def group_start(self) -> None:
        if "HcclGroupStart" not in self._fn:
            raise DeviceArgumentError(f"{self.path} has no HcclGroupStart (it needs a newer CANN)")
        self._call("HcclGroupStart")

    def group_end(self) -> None:
        if "HcclGroupEnd" not in self._fn:
            raise DeviceArgumentError(f"{self.path} has no HcclGroupEnd (it needs a newer CANN)")
        self._call("HcclGroupEnd")

    # --- torch glue (torch_npu only imported here) -------------------------------------------
    dtype_code = staticmethod(hccl_dtype)

    @staticmethod
    def current_stream(device) -> int:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return int(torch.npu.current_stream(device).npu_stream)  # type: ignore[attr-defined]  # added by torch_npu

    @staticmethod
    def set_device(device) -> None:
        import torch
        import torch_npu  # noqa: F401

        torch.npu.set_device(device)  # type: ignore[attr-defined]  # added by torch_npu


def hccl(path: str | None = None) -> HcclLibrary:
    """Load HCCL (explicit `path`, else discovery); the dlopen itself happens once per file."""
    return HcclLibrary(path)
