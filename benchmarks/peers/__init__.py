"""Peers measured on the same workload as dockd, in the same run.

- ``dockd_central``: dockd with one central warehouse (controller and
  warehouse in one daemon), the layout a central replay buffer has.
- ``transferqueue``: TransferQueue (PyPI ``transferqueue``, used by verl),
  its default SimpleStorage backend, ``polling_mode=True``.
- ``ray_buffer``: one Ray actor holding per-column lists of tensors, written
  the way MindSpeed-RL's TransferDock works.

All three drive :func:`benchmarks.peers.workload.run_workload` through a
:class:`~benchmarks.peers.workload.PeerAdapter`. Peers install with
``pip install -e '.[peers]'`` from the repository root; a missing peer is
reported as skipped with that hint, and the other scenarios still run.
"""

PEERS_INSTALL_HINT = "pip install -e '.[peers]' from the repository root (or: pip install transferqueue ray)"
