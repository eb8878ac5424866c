"""The dockd exception tree: every error the package raises on purpose.

    DockError
    ├── DockTimeout            (retryable: not enough samples were ready in time)
    ├── DockFull               (retryable: a warehouse stayed full past the timeout)
    ├── DockNotFound           (unknown partition or sample index; also a KeyError)
    │   └── StagingUnknown     (internal: a warehouse no longer maps a writer's staging buffer)
    ├── DockDataLost           (the warehouse holding some samples is gone)
    ├── DockClosed             (this client or the daemon was closed while waiting)
    ├── DockConnectionError    (a daemon cannot be reached or hung up)
    ├── DockAuthError          (the token is missing or wrong, or the request needs another role)
    ├── DockLeaseError         (the lease is not this client's, or expired before its confirm)
    ├── DockDrained            (the partition is sealed and nothing is left for this get)
    ├── DockStateFull          (retryable: the controller's state dir is full; nothing was applied)
    ├── DockConfigError        (the dock's daemons were started with settings that disagree)
    ├── DockProtocolError      (a peer sent a malformed frame)
    ├── DockValueError         (bad argument; also a ValueError)
    ├── DockTypeError          (argument of the wrong type; also a TypeError)
    └── DockDeviceError        (dockd.device, the NCCL/HCCL bindings: DeviceLibraryNotFound, ...)

`dockd.resharding` has a tree of its own (ReshardError): resharding talks to no dock.

Retryable errors leave the dock as it was. Errors are carried on the wire as a
`dockd.v1.Code` plus a message (see proto/dockd/v1/dockd.proto) and mapped back
to these classes once, in `from_status`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dockd._proto import dockd_pb2


class DockError(Exception):
    """Base class of every error dockd raises on purpose."""


class DockTimeout(DockError, TimeoutError):
    """Fewer samples than requested were ready when the timeout passed."""

    def __init__(self, message: str, *, ready: int = 0) -> None:
        super().__init__(message)
        self.ready = ready


class DockFull(DockError):
    """A warehouse stayed at capacity for the whole put timeout."""


class DockNotFound(DockError, KeyError):
    """An unknown partition or sample index was named."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DockDataLost(DockError):
    """Samples whose data lived on a warehouse that is gone."""

    def __init__(self, message: str, *, indexes: Sequence[int] = (), columns: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.indexes = list(indexes)
        self.columns = list(columns)


class DockClosed(DockError):
    """The client was closed, the daemon shut down, or the partition was cleared while waiting."""


class DockConnectionError(DockError, ConnectionError):
    """A daemon could not be reached or closed the connection."""

    refused = False  # nothing listened at the address (yet): a starting daemon, or a wrong port
    timed_out = False  # the daemon did not answer in time
    retry = True  # another transport may still reach the daemon
    replaced = False  # the client replaced these connections (a reconnect): send the call over the new ones


class DockAuthError(DockError):
    """The dock refused this connection or request: no token, a wrong token, or a request
    that needs another role (daemon-to-daemon messages from a client)."""


class DockLeaseError(DockError):
    """A lease operation that was refused: the lease belongs to another client (and no
    hand-over ticket came with it), or it expired or was released, so its samples were
    handed out again."""


class DockDrained(DockError):
    """The partition is sealed (no new samples) and nothing more can come for this get: every
    sample the consumer could have was handed out. The end of a stream."""


class DockStateFull(DockError):
    """The controller could not journal this request in its state dir (the disk is full, or
    writing there failed), so it applied nothing. Retryable: the dock resumes by itself once
    there is room again."""


class DockConfigError(DockError):
    """The dock's daemons were started with settings that disagree (e.g. two controllers given
    different --controllers lists), so the dock refuses service rather than split; the message shows
    both settings and which daemon to restart with what."""


class DockProtocolError(DockError):
    """A peer sent bytes that are not a valid dockd frame."""


class DockValueError(DockError, ValueError):
    """An argument has the right type but a wrong value."""


class DockTypeError(DockError, TypeError):
    """An argument has the wrong type."""


class StagingUnknown(DockNotFound):
    """A warehouse no longer maps the staging buffer a same-host put named (it keeps a few per
    writer, and forgets them on a restart); the client registers it again. Internal: a put
    never raises it to its caller."""


def from_status(status: dockd_pb2.Status) -> DockError:
    """Map a wire Status (code != OK) to the matching exception."""
    from dockd._proto import dockd_pb2 as pb

    code, msg = status.code, status.message
    if code == pb.TIMEOUT:
        return DockTimeout(msg, ready=status.ready)
    if code == pb.FULL:
        return DockFull(msg)
    if code == pb.NOT_FOUND:
        return DockNotFound(msg)
    if code == pb.STAGING_UNKNOWN:
        return StagingUnknown(msg)
    if code == pb.DATA_LOST:
        return DockDataLost(msg, indexes=status.lost_indexes, columns=status.lost_columns)
    if code == pb.CLOSED:
        return DockClosed(msg)
    if code == pb.INVALID_ARGUMENT:
        return DockValueError(msg)
    if code == pb.PROTOCOL:
        return DockProtocolError(msg)
    if code in (pb.AUTH, pb.WRONG_ROLE):
        return DockAuthError(msg)
    if code == pb.LEASE:
        return DockLeaseError(msg)
    if code == pb.DRAINED:
        return DockDrained(msg)
    if code == pb.STATE_FULL:
        return DockStateFull(msg)
    if code == pb.CONFIG:
        return DockConfigError(msg)
    if code == pb.UNAVAILABLE:
        err = DockConnectionError(msg)
        err.retry = False  # the daemon that answered is there: re-sending to it (or another) would not help now
        return err
    return DockError(f"{pb.Code.Name(code) if code in pb.Code.values() else code}: {msg}")


def to_status(exc: BaseException, status: dockd_pb2.Status) -> None:
    """Fill a wire Status from an exception (the reverse of from_status)."""
    from dockd._proto import dockd_pb2 as pb

    status.message = str(exc)
    if isinstance(exc, DockTimeout):
        status.code, status.ready = pb.TIMEOUT, exc.ready
    elif isinstance(exc, DockFull):
        status.code = pb.FULL
    elif isinstance(exc, StagingUnknown):
        status.code = pb.STAGING_UNKNOWN
    elif isinstance(exc, DockNotFound):
        status.code = pb.NOT_FOUND
    elif isinstance(exc, DockDataLost):
        status.code = pb.DATA_LOST
        status.lost_indexes.extend(exc.indexes)
        status.lost_columns.extend(exc.columns)
    elif isinstance(exc, DockClosed):
        status.code = pb.CLOSED
    elif isinstance(exc, DockProtocolError):
        status.code = pb.PROTOCOL
    elif isinstance(exc, DockAuthError):
        status.code = pb.AUTH
    elif isinstance(exc, DockLeaseError):
        status.code = pb.LEASE
    elif isinstance(exc, DockDrained):
        status.code = pb.DRAINED
    elif isinstance(exc, DockStateFull):
        status.code = pb.STATE_FULL
    elif isinstance(exc, DockConfigError):
        status.code = pb.CONFIG
    elif isinstance(exc, DockConnectionError):
        status.code = pb.UNAVAILABLE
    elif isinstance(exc, (ValueError, TypeError)):
        status.code = pb.INVALID_ARGUMENT
    else:
        status.code = pb.INTERNAL
        status.message = f"{type(exc).__name__}: {exc}"
