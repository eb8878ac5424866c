"""The build hook: the request path's pure modules compiled with mypyc where that can be done.

pyproject.toml holds the project's metadata; this file only adds the compiled modules. A wheel built
where mypyc (the `dev` extra's mypy) and a C compiler are present holds, next to each module of
`COMPILED`, the extension compiled from that same source; Python imports the extension first and the
`.py` is the fallback. Built anywhere else, or with DOCKD_PURE=1, the wheel is pure Python. A failed
compile also falls back to pure Python: an install never fails for lack of a compiler.

`make dist` builds without isolation, with the virtualenv's mypy (`python -m build --no-isolation`);
an isolated build (`pip install` of the sdist, `python -m build`) has only setuptools and is pure. An
editable install (`make setup`) is never compiled: extensions next to the sources would shadow edits.
`make test-compiled` runs the unit tests against a compiled copy of the checkout.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The controller's request path (every module of dockd/controller/: the core and the service around it;
# tests/unit/test_compiled.py checks none is left out), the request checks, the daemon's frame path
# (parsing, the connection, dispatch), and the read path's replies (warehouse/fetch.py: an acquire's inline
# values; 33-34 -> 30.5-31 us per one-sample get in process). A compiled class checks every argument
# annotated with it (the tests' fake connections subclass Peer) and can be subclassed by interpreted code
# only where it is marked `@mypyc_attr(allow_interpreted_subclasses=True)` (Peer, FrameReader).
# The client is pure Python. Its side of a small get compiles (Getter, Acquirer, Connection, ReplyWaits:
# dockd/client/get.py, acquirer.py, dockd/net/connection.py, reply_waits.py) and so cuts the client's
# instructions per one-sample get from 264k to 243k, but not the get's latency (request_cost, pinned, pairs
# alternating: one CPU 225 -> 224 us over 8, client on the other CPU 201 -> 211 us over 16, both within the
# machine's noise): they are left out. Its other modules cannot be compiled as they are: Dock (users subclass
# it, tests patch it), Router and Pool (tests replace their methods on an instance), Confirms (its flusher
# holds it by a weak reference, which a compiled class does not take), Fetcher (a test patches its method),
# GetOptions (`frame` checks its values with the errors the API documents; typed fields would raise first).
COMPILED = [
    "dockd/controller/agreement.py",
    "dockd/controller/block_drops.py",
    "dockd/controller/block_service.py",
    "dockd/controller/blocks.py",
    "dockd/controller/catalog.py",
    "dockd/controller/catalog_runs.py",
    "dockd/controller/changes.py",
    "dockd/controller/commit_runs.py",
    "dockd/controller/checkpoint.py",
    "dockd/controller/clock.py",
    "dockd/controller/core.py",
    "dockd/controller/eligible.py",
    "dockd/controller/grants.py",
    "dockd/controller/journal.py",
    "dockd/controller/lease_table.py",
    "dockd/controller/member.py",
    "dockd/controller/membership.py",
    "dockd/controller/pacing.py",
    "dockd/controller/partition.py",
    "dockd/controller/partition_ops.py",
    "dockd/controller/persist.py",
    "dockd/controller/probes.py",
    "dockd/controller/reads.py",
    "dockd/controller/records.py",
    "dockd/controller/replica_map.py",
    "dockd/controller/replica_service.py",
    "dockd/controller/rounds.py",
    "dockd/controller/selection.py",
    "dockd/controller/service.py",
    "dockd/controller/sessions.py",
    "dockd/controller/syncing.py",
    "dockd/controller/waiters.py",
    "dockd/controller/warehouse_calls.py",
    "dockd/controller/warehouses.py",
    "dockd/ids.py",
    "dockd/limits.py",
    "dockd/net/frame_reader.py",
    "dockd/net/peer.py",
    "dockd/net/wire.py",
    "dockd/node/dispatch.py",
    "dockd/node/metrics.py",
    "dockd/warehouse/fetch.py",
]


def _why_pure() -> str | None:
    """Why this build is pure Python, or None: compile."""
    if os.environ.get("DOCKD_PURE", "") not in ("", "0"):
        return "DOCKD_PURE is set"
    if any(cmd in sys.argv for cmd in ("editable_wheel", "develop")):
        return "an editable install runs the sources"
    if not any(cmd in sys.argv for cmd in ("bdist_wheel", "build_ext", "build", "install")):
        return "not building a wheel"  # (sdist, egg_info, dist_info: nothing to compile)
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypyc is not installed (it comes with mypy, in the dev extra)"
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    return None


class FallibleBuildExt(build_ext):
    """build_ext that leaves the wheel pure Python when compiling fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - CompileError, LinkError, a missing header: all mean pure Python
            print(f"dockd: compiling failed ({e}); the pure-Python modules are used", file=sys.stderr)
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    os.remove(path)
            self.extensions = []


def _ext_modules() -> list:
    why = _why_pure()
    if why is not None:
        if why != "not building a wheel":
            print(f"dockd: building pure Python: {why}", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    try:
        return mypycify(COMPILED, opt_level=os.environ.get("MYPYC_OPT_LEVEL", "3"))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - mypyc exits on a type error: fall back, saying which
        print(f"dockd: mypyc cannot compile the listed modules ({e!r}); the pure-Python modules are used",
              file=sys.stderr)
        return []


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": FallibleBuildExt})
