"""Errors of the device bindings; all of them are `dockd.errors.DockError`s.

    DockDeviceError                 (base; also exported as DeviceError)
    ├── DeviceLibraryNotFound       (libnccl.so.2 / libhccl.so could not be found or loaded)
    ├── DeviceDTypeError            (a tensor dtype the backend has no type code for; also a TypeError)
    ├── DeviceArgumentError         (wrong device, shape, rank or state; also a ValueError)
    └── CollectiveError             (a library call returned something other than success)
        ├── NcclError
        └── HcclError
"""

from __future__ import annotations

from dockd.errors import DockError


class DockDeviceError(DockError):
    """Base class of the errors raised by `dockd.device`."""


DeviceError = DockDeviceError


class DeviceLibraryNotFound(DockDeviceError):
    """The collective library could not be found or loaded.

    `searched` lists every location that was tried, in order.
    """

    def __init__(self, message: str, *, library: str = "", searched: list[str] | None = None) -> None:
        super().__init__(message)
        self.library = library
        self.searched = list(searched or [])


class DeviceDTypeError(DockDeviceError, TypeError):
    """A tensor dtype the backend has no data type code for."""


class DeviceArgumentError(DockDeviceError, ValueError):
    """A tensor on the wrong device, a size mismatch, a bad rank, or a call in the wrong state."""


class CollectiveError(DockDeviceError):
    """A collective library call returned a code other than success.

    Attributes:
        backend: "nccl" or "hccl".
        function: the C function that failed, e.g. "ncclCommInitRank".
        code: the integer return code.
        code_name: its enum name, e.g. "ncclUnhandledCudaError".
        library_message: the library's own text for the code (ncclGetErrorString / HcclGetErrorString).
        last_error: the library's last error message (ncclGetLastError), "" when unavailable or empty.
    """

    def __init__(self, *, backend: str, function: str, code: int, code_name: str,
                 library_message: str, last_error: str = "") -> None:
        self.backend = backend
        self.function = function
        self.code = code
        self.code_name = code_name
        self.library_message = library_message
        self.last_error = last_error
        text = f"{function} failed: {code_name} ({code}): {library_message}"
        if last_error:
            text += f"; last error: {last_error}"
        super().__init__(text)

    def __reduce__(self):  # picklable across processes (keyword-only __init__)
        return _rebuild, (type(self), self.backend, self.function, self.code, self.code_name,
                          self.library_message, self.last_error)


def _rebuild(cls, backend, function, code, code_name, library_message, last_error):
    return cls(backend=backend, function=function, code=code, code_name=code_name,
               library_message=library_message, last_error=last_error)


class NcclError(CollectiveError):
    """An NCCL call failed."""


class HcclError(CollectiveError):
    """An HCCL call failed."""
