"""allgather-swap weight resharding for RL post-training.

When an RL step switches from training to generation, the weights change
parallel layout.  :class:`AllGatherSwap` builds the generation-layout weights
from this rank's training shards (TP all-gather, EP all-to-all, PP broadcast)
and swaps the training ("update") weights to pinned host memory for the
duration of generation, so no redundant copy stays on the device.

Quick use (every rank)::

    from dockd.resharding import AllGatherSwap, ParallelLayout, ParamSpec

    ags = AllGatherSwap(specs, my_shards, train=ParallelLayout(tp=4, pp=2),
                        gen=ParallelLayout(tp=2))
    weights = ags.enter_generation()     # name -> generation tensor
    ...                                  # generate
    ags.prefetch_update_weights()        # overlap the swap-back
    ags.exit_generation()                # my_shards are resident again
    print(ags.last_report)

See ``docs/resharding.md`` for the algorithm and the memory model.
"""

from .allgather_swap import AllGatherSwap, ReshardConfig, ReshardReport, ReshardState
from .collectives import Collectives, DeviceCollectives, TorchCollectives
from .device import DeviceInfo, detect_device
from .errors import BackendError, LayoutError, ReshardError, ReshardStateError
from .groups import ReshardGroups, build_groups
from .layout import (
    ParallelLayout,
    ParamSpec,
    generation_local_shape,
    plan_reslice,
    training_local_shape,
    validate_layouts,
)
from .memory import MemoryModel, predict_memory

__all__ = [
    "AllGatherSwap",
    "BackendError",
    "Collectives",
    "DeviceCollectives",
    "DeviceInfo",
    "LayoutError",
    "MemoryModel",
    "ParallelLayout",
    "ParamSpec",
    "ReshardConfig",
    "ReshardError",
    "ReshardGroups",
    "ReshardReport",
    "ReshardState",
    "ReshardStateError",
    "TorchCollectives",
    "build_groups",
    "detect_device",
    "generation_local_shape",
    "plan_reslice",
    "predict_memory",
    "training_local_shape",
    "validate_layouts",
]
