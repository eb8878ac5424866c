"""ctypes bindings of NCCL (libnccl.so.2), checked against nccl.h of nvidia-nccl-cu13 2.32.3.

Only what dockd moves samples with: version, unique id, communicator init/destroy/abort,
send, recv, broadcast, all_gather, group start/end, and the error strings. Every call
that returns something other than ncclSuccess raises `NcclError`.
"""

from __future__ import annotations

import ctypes

from dockd.device import _torch_dtypes
from dockd.device.discovery import bind, load_nccl_library
from dockd.device.errors import DeviceArgumentError, DeviceDTypeError, NcclError

NCCL_UNIQUE_ID_BYTES = 128


def own_host_env(name: str) -> dict[str, str]:
    """Environment that lets this process's NCCL rank share one GPU with another process's rank.

    NCCL refuses two ranks of one communicator on the same GPU of the same host ("Duplicate GPU
    detected", ncclInvalidUsage, since NCCL 2.5), and no setting turns that check off. It tells
    hosts apart by a hash of NCCL_HOSTID (else hostname and boot id), read once per process at
    its first communicator. So each process claims a host of its own, named `name`, and the
    ranks talk over NCCL's socket transport on loopback, with no peer-to-peer, shared-memory or
    NVLink-SHARP paths between "hosts". For tests and benchmarks on a machine with one GPU: it
    measures sockets, not the GPU's links, and never belongs on a real cluster. Set it in each
    process before that process's first NCCL call (a daemon inherits it when it is started).
    """
    return {"NCCL_HOSTID": f"dockd-{name}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1",
            "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


class NcclUniqueId(ctypes.Structure):
    """typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;"""

    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
ncclResult_t = ctypes.c_int      # C enum: int-sized
ncclDataType_t = ctypes.c_int    # C enum: int-sized

# ncclResult_t (nccl.h 2.32.3)
RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",   # in the 2.32.3 header; absent from older ones
}

# ncclDataType_t (nccl.h 2.32.3)
ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64 = 0, 1, 2, 3, 4, 5
ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16 = 6, 7, 8, 9
ncclFloat8e4m3, ncclFloat8e5m2 = 10, 11   # present in the 2.32.3 header; older libraries reject them

# torch dtype -> ncclDataType_t. bool travels as uint8 (same size; this is what torch's
# ProcessGroupNCCL does too); the transfers here never reduce, so only the size matters.
# NCCL has no 16-bit integer or complex types: those are refused.
DTYPES = _torch_dtypes.table([
    ("int8", ncclInt8), ("uint8", ncclUint8), ("bool", ncclUint8),
    ("int32", ncclInt32), ("uint32", ncclUint32), ("int64", ncclInt64), ("uint64", ncclUint64),
    ("float16", ncclFloat16), ("float32", ncclFloat32), ("float64", ncclFloat64), ("bfloat16", ncclBfloat16),
    ("float8_e4m3fn", ncclFloat8e4m3), ("float8_e5m2", ncclFloat8e5m2),
])


def nccl_dtype(dtype) -> int:
    """The ncclDataType_t code for a torch dtype; DeviceDTypeError for one NCCL cannot carry."""
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in DTYPES))
        raise DeviceDTypeError(f"NCCL has no data type for {dtype}; supported: {names}") from None


# (name, restype, argtypes, required)
_SIGNATURES = [
    ("ncclGetVersion", ncclResult_t, [ctypes.POINTER(ctypes.c_int)], True),
    ("ncclGetUniqueId", ncclResult_t, [ctypes.POINTER(NcclUniqueId)], True),
    ("ncclGetErrorString", ctypes.c_char_p, [ncclResult_t], True),
    ("ncclGetLastError", ctypes.c_char_p, [ncclComm_t], False),           # NCCL >= 2.13
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank); id by value
    ("ncclCommInitRank", ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int], True),
    ("ncclCommDestroy", ncclResult_t, [ncclComm_t], True),
    ("ncclCommAbort", ncclResult_t, [ncclComm_t], False),
    # ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t, cudaStream_t)
    ("ncclSend", ncclResult_t, [ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t,
                                cudaStream_t], True),
    ("ncclRecv", ncclResult_t, [ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t,
                                cudaStream_t], True),
    # ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t, int root, comm, stream)
    ("ncclBroadcast", ncclResult_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t,
                                     ctypes.c_int, ncclComm_t, cudaStream_t], True),
    # ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t, comm, stream)
    ("ncclAllGather", ncclResult_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t,
                                     ncclComm_t, cudaStream_t], True),
    ("ncclGroupStart", ncclResult_t, [], True),
    ("ncclGroupEnd", ncclResult_t, [], True),
]


class NcclLibrary:
    """The NCCL C API through ctypes: thin, one method per C function, raising NcclError on failure."""

    name = "nccl"
    device_type = "cuda"
    unique_id_bytes = NCCL_UNIQUE_ID_BYTES

    def __init__(self, path: str | None = None) -> None:
        self.lib, self.path = load_nccl_library(path)
        self._fn = bind(self.lib, self.path, _SIGNATURES,
                        "not an NCCL library, or one too old (dockd needs NCCL >= 2.7)")

    def has(self, fname: str) -> bool:
        return fname in self._fn

    # --- errors ---------------------------------------------------------------------------
    def error_string(self, code: int) -> str:
        s = self._fn["ncclGetErrorString"](code)
        return s.decode(errors="replace") if s else ""

    def last_error(self, comm: int | None = None) -> str:
        f = self._fn.get("ncclGetLastError")
        if f is None:
            return ""
        s = f(comm)
        return s.decode(errors="replace") if s else ""

    def check(self, fname: str, code: int, comm: int | None = None) -> None:
        if code != 0:
            raise NcclError(backend="nccl", function=fname, code=code,
                            code_name=RESULT_NAMES.get(code, f"ncclResult_t({code})"),
                            library_message=self.error_string(code), last_error=self.last_error(comm))

    def _call(self, fname: str, *args, comm: int | None = None) -> None:
        self.check(fname, self._fn[fname](*args), comm)

    # --- API ------------------------------------------------------------------------------
    def version(self) -> int:
        """NCCL_VERSION_CODE of the loaded library: major*10000 + minor*100 + patch (e.g. 23203)."""
        v = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(v))
        return v.value

    def get_unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)

    def comm_init_rank(self, unique_id: bytes, rank: int, nranks: int) -> int:
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise DeviceArgumentError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = NcclUniqueId.from_buffer_copy(unique_id)
        comm = ncclComm_t()
        self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        assert comm.value is not None, "ncclCommInitRank succeeded without writing a communicator"
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self._call("ncclCommDestroy", comm, comm=None)

    def comm_abort(self, comm: int) -> None:
        if "ncclCommAbort" in self._fn:
            self._call("ncclCommAbort", comm, comm=None)
        else:
            self.comm_destroy(comm)

    def send(self, ptr: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclSend", ptr, count, dtype, peer, comm, stream, comm=comm)

    def recv(self, ptr: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclRecv", ptr, count, dtype, peer, comm, stream, comm=comm)

    def broadcast(self, ptr: int, count: int, dtype: int, root: int, comm: int, stream: int) -> None:
        self._call("ncclBroadcast", ptr, ptr, count, dtype, root, comm, stream, comm=comm)   # in place

    def all_gather(self, send_ptr: int, recv_ptr: int, send_count: int, dtype: int, comm: int,
                   stream: int) -> None:
        self._call("ncclAllGather", send_ptr, recv_ptr, send_count, dtype, comm, stream, comm=comm)

    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        self._call("ncclGroupEnd")

    # --- torch glue (torch.cuda only touched here) -------------------------------------------
    dtype_code = staticmethod(nccl_dtype)

    @staticmethod
    def current_stream(device) -> int:
        import torch

        return int(torch.cuda.current_stream(device).cuda_stream)

    @staticmethod
    def set_device(device) -> None:
        import torch

        torch.cuda.set_device(device)


def nccl(path: str | None = None) -> NcclLibrary:
    """Load NCCL (explicit `path`, else discovery); the dlopen itself happens once per file."""
    return NcclLibrary(path)
