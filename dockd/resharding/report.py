"""What :class:`~dockd.resharding.AllGatherSwap` is told and what it tells back: its
configuration, its state, the report of each call, and the phase clock that times it."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .device import DeviceInfo
from .errors import LayoutError
from .layout import DEFAULT_GATHER_CHUNK_BYTES

__all__ = ["PhaseClock", "ReshardConfig", "ReshardReport", "ReshardState", "log_report"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ReshardConfig:
    """Knobs of :class:`AllGatherSwap`."""

    mode: Literal["swap", "resident"] = "swap"
    """``"swap"``: allgather-swap (update weights leave the device during
    generation).  ``"resident"``: the naive reference that keeps them."""
    chunk_bytes: int = 64 << 20
    """Chunk size of host-to-device copies when swapping back."""
    gather_chunk_bytes: int | None = DEFAULT_GATHER_CHUNK_BYTES
    """Bound on one all-gather temporary: larger parameters are gathered in
    chunks of rows (at least one row per TP rank).  ``None`` gathers each
    parameter whole."""

    def __post_init__(self) -> None:
        if self.mode not in ("swap", "resident"):
            raise LayoutError(f"ReshardConfig.mode must be 'swap' or 'resident', got {self.mode!r}")
        if self.chunk_bytes <= 0:
            raise LayoutError(f"ReshardConfig.chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.gather_chunk_bytes is not None and self.gather_chunk_bytes <= 0:
            raise LayoutError(
                f"ReshardConfig.gather_chunk_bytes must be positive or None, got {self.gather_chunk_bytes}"
            )


@dataclass(kw_only=True, slots=True)
class ReshardReport:
    """What one call moved, held and spent.  Byte counts are for this rank."""

    call: str
    mode: str
    gathered_bytes: int = 0
    """Output bytes of the TP all-gathers (temporary buffers)."""
    alltoall_bytes: int = 0
    """Expert bytes received by the EP all-to-alls."""
    broadcast_bytes: int = 0
    """Bucket bytes moved by the PP broadcasts (sent or received)."""
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    """exit_generation: update bytes made resident again, including those a
    prefetch already copied (then ``prefetched`` is true)."""
    prefetched: bool = False
    """exit_generation: the swap-back had been started by prefetch."""
    pinned: bool = False
    device_bytes_before: int = 0
    device_bytes_after: int = 0
    peak_device_bytes: int = 0
    """Peak of the module's device-byte accounting during the call."""
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    def gbps(self, phase: str, nbytes: int) -> float:
        """Throughput of ``nbytes`` over ``phase`` in GB/s (0 if not timed)."""
        seconds = self.phase_seconds.get(phase, 0.0)
        return nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReshardState(enum.Enum):
    """Where an AllGatherSwap is: ``TRAINING`` (update weights resident; ``enter_generation`` next),
    ``GENERATION`` (generation weights built; ``exit_generation`` next) or ``CLOSED``."""

    TRAINING = "training"
    GENERATION = "generation"
    CLOSED = "closed"


class PhaseClock:
    """Times the phases of one call into ``phases`` (seconds by name, summed when a phase
    repeats); each lap waits for the device first, so it counts the work, not its issue."""

    __slots__ = ("_device", "_t", "phases")

    def __init__(self, device: DeviceInfo, phases: dict[str, float]) -> None:
        self._device = device
        self.phases = phases
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        """Charge the time since the last lap (or the start) to phase ``name``."""
        self._device.synchronize()
        t = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + (t - self._t)
        self._t = t

    def issued(self, name: str) -> None:
        """Charge the time since the last lap to ``name`` without waiting for the device
        (work that keeps running on a side stream)."""
        t = time.perf_counter()
        self.phases[name] = t - self._t
        self._t = t


def log_report(report: ReshardReport, rank: int) -> None:
    logger.info(
        "[reshard] %s rank=%d mode=%s gathered=%d alltoall=%d broadcast=%d out=%d in=%d "
        "device_bytes=%d peak=%d seconds=%.4f",
        report.call, rank, report.mode, report.gathered_bytes, report.alltoall_bytes,
        report.broadcast_bytes, report.swapped_out_bytes, report.swapped_in_bytes,
        report.device_bytes_after, report.peak_device_bytes, report.total_seconds,
    )
