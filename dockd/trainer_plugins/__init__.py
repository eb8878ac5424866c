"""Trainer plugins: put dockd under the RL loops people already run.

    dockd.trainer_plugins.openrlhf       DockReplayBuffer, install()      pip install -e '.[openrlhf]'
    dockd.trainer_plugins.verl           DataProto <-> dock, dispatch mode,
                                         transfer_queue-compatible client pip install -e '.[verl]'
    dockd.trainer_plugins.megatron_grpo  GRPO pipeline over the dock       pip install -e '.[megatron]'

Dependencies point one way: a plugin imports the dockd client, the core never
imports a plugin. Importing a plugin module imports none of its framework;
the framework is imported the first time a plugin object needs it, and a
missing framework raises an ImportError naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str, what: str) -> ModuleType:
    """Import `module` for a plugin, or fail with an ImportError that says what to install.

    Args:
        module: the framework module to import, e.g. ``"verl.protocol"``.
        extra: the dockd extra that installs it, e.g. ``"verl"``.
        what: what needed it, for the message, e.g. ``"dockd.trainer_plugins.verl.put_data_proto"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise ImportError(
            f"{what} needs the {top!r} package, which could not be imported ({exc}). "
            f"Install it with: pip install -e '.[{extra}]' (from a dockd checkout) "
            f"(or scripts/install_frameworks.sh for the CPU test setup)."
        ) from exc
