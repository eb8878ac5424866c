"""One daemon per directory: an exclusive lock on DIR/lock, held for the life of the process.

A warehouse's data dir (`--data-dir`) and a controller's state dir (`--state-dir`) each belong to
one process: two writing one dir lose data (a second warehouse rewrote the first one's identity and
files; a second controller adopted the first one's partitions and forgot a consumer's progress). So
the daemon takes `flock(LOCK_EX | LOCK_NB)` on a lock file in the dir before it reads anything there,
and keeps the descriptor open until it exits; it writes its pid into the file for the message a
second daemon gets. The kernel drops the lock with the process however it ends (SIGKILL included),
so a killed daemon leaves no stale lock: a restart waits at most `WAIT` seconds for a process that
is still exiting, and a daemon that finds the dir held past that refuses to start.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time

LOCK = "lock"
WAIT = 3.0  # seconds a start waits for the holder to go (a killed process still exiting) before refusing


def hold(path: str, flag: str, error: type[Exception]) -> int:
    """Lock the dir `path` (given as `flag` DIR) for this process; the descriptor that holds the lock.
    Raises `error` naming the dir, the holder's pid and what to do when another process holds it."""
    lock = os.path.join(path, LOCK)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise error(f"{flag} {path}: cannot open its lock file {lock} ({e.strerror or e}); it must be a regular "
                    "file this user can write (remove whatever is there)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{flag} {path}: {lock} is not a regular file; remove it and start again")
        deadline = time.monotonic() + WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _held(fd, path, lock, flag, error) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _held(fd: int, path: str, lock: str, flag: str, error: type[Exception]) -> Exception:
    try:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        pid = ""
    who = f"pid {pid}" if pid.isdigit() else "a process whose pid is not written yet"
    stop = f"stop that process (kill {pid})" if pid.isdigit() else "stop that process"
    return error(f"{flag} {path} is in use by another dockd process ({who}, which holds {lock}): one daemon per "
                 f"dir, since two would overwrite each other's files. {stop.capitalize()} first, or give this one "
                 f"another {flag}")


def release(fd: int) -> None:
    """Give the lock back (a process exiting does so anyway)."""
    if fd >= 0:
        os.close(fd)
