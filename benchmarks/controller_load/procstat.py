"""CPU counters from /proc: per process (utime + stime) and for the whole machine."""

from __future__ import annotations

import os

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system, ``/proc/<pid>/stat`` fields 14 and 15) used so far by these processes;
    threads included, children not; a process that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / _HZ


def machine_cpu() -> tuple[float, float]:
    """(busy, total) seconds of all CPUs together, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / _HZ, total / _HZ
