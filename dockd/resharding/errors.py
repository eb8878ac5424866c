"""Errors raised by the resharding module.

Exception tree::

    ReshardError (RuntimeError)
    ├── LayoutError (ValueError)        bad specs, layouts or weights; fix the input
    ├── ReshardStateError               call made in the wrong lifecycle state
    └── BackendError                    device/backend mismatch or collective failure

``LayoutError`` is also a ``ValueError`` so callers that validate input with
``except ValueError`` keep working.
"""

from __future__ import annotations

__all__ = ["BackendError", "LayoutError", "ReshardError", "ReshardStateError"]


class ReshardError(RuntimeError):
    """Base class of every error raised by ``dockd.resharding`` (not a ``DockError``: resharding
    talks to no dock)."""


class LayoutError(ReshardError, ValueError):
    """A parameter spec, a parallel layout or a set of weights is invalid.

    The message names the offending field and what a valid value looks like.
    """


class ReshardStateError(ReshardError):
    """An ``AllGatherSwap`` method was called in the wrong state.

    For example ``exit_generation()`` without a prior ``enter_generation()``,
    or any call after ``close()``.
    """


class BackendError(ReshardError):
    """The weights' device does not match the ``torch.distributed`` backend,
    or the process group is not initialised."""
