"""DaemonActor: the Ray actor that owns one `dockd serve` process on its node, and the exec
wrapper that makes the kernel kill that process when the actor's process dies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

from dockd._ray.common import format_address, logger, ray_module
from dockd.local import spawn_node

_PR_SET_PDEATHSIG = 1
# Run as `python -c CODE PARENT_PID PROGRAM ARGS...`: arm "kill me when my parent dies",
# make sure the parent did not die before that, then become PROGRAM. The setting survives
# execve, so it holds for the daemon itself.
_DEATH_TIE = (
    "import ctypes, os, signal, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({_PR_SET_PDEATHSIG}, int(signal.SIGKILL), 0, 0, 0) != 0:\n"
    "    sys.exit('dockd.ray: prctl(PR_SET_PDEATHSIG) failed: errno %d' % ctypes.get_errno())\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('dockd.ray: the owning actor exited before its daemon started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def death_tie_prefix() -> list[str]:
    """The `spawn_node` prefix that kills the daemon when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        logger.warning("[ray] PR_SET_PDEATHSIG is Linux-only: on %s a daemon outlives its actor if the actor is "
                       "killed; stop the dock with dockd.ray.shutdown()", sys.platform)
        return []
    return [sys.executable, "-I", "-c", _DEATH_TIE, str(os.getpid())]


def _token_file(token: str) -> str:
    """A new file, readable by this user only, holding `token`, alone in a new folder; its path."""
    folder = tempfile.mkdtemp(prefix="dockd-ray-")  # mode 700
    path = os.path.join(folder, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


class DaemonActor:
    """Owns one `dockd serve` process on its node (a Ray actor; see the `dockd.ray` docstring)."""

    def __init__(self, role: str, node_id: str) -> None:
        here = ray_module().get_runtime_context().get_node_id()
        if here != node_id:  # cannot happen with hard node affinity; guards the one-per-node layout
            raise RuntimeError(f"dockd {role} actor meant for Ray node {node_id} was placed on node {here}")
        self._role = role
        self._node_id = here
        self._proc: subprocess.Popen | None = None
        self._ready: dict[str, Any] = {}
        self._joined = ""  # the controller this daemon belongs to
        self._token = ""
        self._daemon_token = ""
        self._stopping = False
        self._lock = threading.Lock()

    def start(self, args: list[str], timeout: float, token: str = "", daemon_token: str = "") -> dict[str, Any]:
        """Start the daemon with `args` (bound on this node's IP) unless it runs already; its info."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._info()
            host = ray_module().util.get_node_ip_address()
            self._stopping = False
            files = []  # the token files: the daemon reads them as it starts, so they go once it is up (or failed)
            if token:
                self._token = token
                files.append(_token_file(token))
                args = [*args, "--token-file", files[-1]]
            if daemon_token:
                self._daemon_token = daemon_token
                files.append(_token_file(daemon_token))
                args = [*args, "--daemon-token-file", files[-1]]
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            # Forked from the actor's main thread, where Ray runs a default (max_concurrency=1)
            # actor's methods: PR_SET_PDEATHSIG fires when the forking *thread* ends, and that
            # thread lives as long as the actor's process.
            try:
                proc, ready = spawn_node(["--host", host, *args], timeout=timeout, env=env,
                                         prefix=death_tie_prefix())
            finally:
                for path in files:
                    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            self._proc, self._ready = proc, ready
            self._joined = args[args.index("--join") + 1] if "--join" in args else self._address()
            threading.Thread(target=self._monitor, args=(proc,), name="dockd-daemon-monitor", daemon=True).start()
            logger.info("[ray] started %s node=%s address=%s pid=%d warehouse=%s", self._role, self._node_id,
                        self._address(), proc.pid, ready.get("warehouse"))
            return self._info()

    def token(self) -> str:
        """The dock's token (Ray processes of this cluster are trusted with it)."""
        return self._token

    def daemon_token(self) -> str:
        """The token the dock's daemons prove to each other (for warehouses started later; clients
        never get it)."""
        return self._daemon_token

    def address(self) -> str | None:
        """The daemon's "host:port" while it runs, else None."""
        with self._lock:
            return self._address() if self._running() else None

    def info(self) -> dict[str, Any]:
        """Role, node, address, process ids and state of the daemon."""
        with self._lock:
            return self._info()

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the daemon (SIGTERM, then SIGKILL after `grace` seconds); its exit code."""
        with self._lock:
            self._stopping = True
            proc = self._proc
            if proc is None:
                return None
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    logger.warning("[ray] %s daemon pid=%d ignored SIGTERM for %.0fs; killing it",
                                   self._role, proc.pid, grace)
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            logger.info("[ray] stopped %s node=%s pid=%d code=%s", self._role, self._node_id, proc.pid,
                        proc.returncode)
            return proc.returncode

    # -- helpers (called with the lock held) --
    def _running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _address(self) -> str:
        return format_address(self._ready["host"], int(self._ready["port"]))

    def _info(self) -> dict[str, Any]:
        proc = self._proc
        return {
            "role": self._role,
            "node_id": self._node_id,
            "address": self._address() if self._ready else None,
            "grpc_port": self._ready.get("grpc_port"),
            "warehouse": self._ready.get("warehouse"),
            "controller": self._joined or None,
            "pid": proc.pid if proc is not None else None,
            "actor_pid": os.getpid(),
            "running": self._running(),
            "exit_code": proc.poll() if proc is not None else None,
        }

    def _monitor(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping or proc is not self._proc:
            return
        logger.error("[ray] %s daemon exited unexpectedly node=%s pid=%d code=%d; ending its actor so that "
                     "the dock notices (see the daemon's messages above in this worker's log)",
                     self._role, self._node_id, proc.pid, code)
        sys.stderr.flush()
        os._exit(1)
