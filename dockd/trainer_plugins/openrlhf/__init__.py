"""OpenRLHF plugin: a replay buffer whose samples live in dockd.

`DockReplayBuffer` is a drop-in for ``openrlhf.trainer.ppo_utils.NaiveReplayBuffer``
(OpenRLHF 0.11) and, when OpenRLHF is importable, a subclass of it (so
``isinstance(buffer, NaiveReplayBuffer)`` holds; the class is built on first
access of ``dockd.trainer_plugins.openrlhf.DockReplayBuffer``, so importing this
module imports no OpenRLHF). Same constructor arguments, same methods, same
batching (it uses OpenRLHF's own ``split_experience_batch`` /
``make_experience_batch``), so ``DataLoader(buffer, batch_size=...,
collate_fn=buffer.collate_fn)`` works as in OpenRLHF's actor and critic
training loops. Two differences: OpenRLHF's ``split_experience_batch`` drops
``Experience.index``; this buffer keeps it per sample, so batches carry the
indexes of their samples. And `append` returns the dock indexes of the new
samples where the original returns None. `append` splits an
``Experience`` per sample and puts the samples into the dock; reads pull the
samples the buffer's consumer has not seen yet into a local view that the
DataLoader indexes. Experience makers on any node append, trainer ranks on any
node read: two buffers with the same ``name`` and ``shard`` share samples.

Switching an OpenRLHF run over is one call before OpenRLHF builds its actors::

    runtime_env = dockd.trainer_plugins.openrlhf.install("10.0.0.1:7450")
    ray.init(runtime_env=runtime_env)          # Ray workers install it too
    train(args)                                # openrlhf.cli.train_ppo_ray.train

Called without an address (and without ``DOCKD_ADDRESS``) after ``ray.init()``,
`install` uses the dock running on the Ray cluster, launching one with
`dockd.ray.launch` if there is none.

Layout in the dock: partition ``"{name}/{shard}"`` (one per shard for the
buffer's whole life: `clear` deletes the samples it drops with `dockd.Dock.delete`,
so every buffer object sharing the name keeps sharing the same samples after any of
them clears), one tensor column per ``Experience`` tensor field
(``"exp/sequences"``, ...) and one ``"exp/meta"`` column carrying the
non-tensor fields (``index``, ``prompts``, ``labels``, ``images``,
``mm_train_inputs``, ``info``) msgpack-encoded, with tensors inside them kept
bit-exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dockd.trainer_plugins.openrlhf.buffer import ENV_ADDRESS, ENV_CONFIG, DockBufferConfig, _dock_replay_buffer_class

# (_ray_worker_setup: named by the runtime_env `install` returns, which Ray workers call)
from dockd.trainer_plugins.openrlhf.switch import _ray_worker_setup, install, uninstall  # noqa: F401

__all__ = ["DockBufferConfig", "DockReplayBuffer", "install", "uninstall", "ENV_ADDRESS", "ENV_CONFIG"]


def __getattr__(name: str) -> Any:
    if name == "DockReplayBuffer":
        return _dock_replay_buffer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from dockd.trainer_plugins.openrlhf.buffer import _DockReplayBufferImpl as DockReplayBuffer  # noqa: F401
