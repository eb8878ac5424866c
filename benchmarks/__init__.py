"""Standalone sample-flow benchmarks for dockd, with its peers side by side.

Run ``python -m benchmarks`` (or ``dockd bench``) from a source checkout. The
runner (``benchmarks/__main__.py``) executes every scenario in a fresh Python
process, collects the JSON each one writes, computes the target ratios from
values measured in that same run, prints a table, writes one JSON file and
draws a PNG plot.

The scenario contract is small. A scenario is a module with:

``NAME: str``
    Its name on the command line (``--only NAME``).
``TITLE: str``
    One line for the table heading.
``requirements() -> str | None``
    ``None`` when the scenario can run here; otherwise a message that says
    what is missing and how to install it. The runner then reports the
    scenario as skipped and runs the rest.
``run(config: BenchConfig) -> dict``
    Does the measurement and returns ``{"rows": [Row.to_dict(), ...], ...}``;
    anything else in the dict (layout, settings) is kept in the JSON under
    the scenario's ``info``.

Scenario modules log through ``logging.getLogger(__name__)`` and configure no
logging; the child entry point (``benchmarks/_child.py``) does that.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Scenario", "SCENARIOS", "scenario_names"]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    """Name used by ``--only``."""
    module: str
    """Importable module path that follows the contract above."""
    default: bool = True
    """Whether a plain ``python -m benchmarks`` runs it."""


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("ceilings", "benchmarks.ceilings"),
    Scenario("dockd_flow", "benchmarks.dockd_flow"),
    Scenario("peer_dockd_central", "benchmarks.peers.dockd_central"),
    Scenario("peer_transferqueue", "benchmarks.peers.transferqueue"),
    Scenario("peer_ray_buffer", "benchmarks.peers.ray_buffer"),
    Scenario("controller_scale", "benchmarks.controller_scale"),
    Scenario("columnar", "benchmarks.columnar"),
    # Owned by the resharding module; runs only when named with --only.
    Scenario("resharding", "benchmarks.resharding", default=False),
)


def scenario_names(*, include_optional: bool = True) -> list[str]:
    return [s.name for s in SCENARIOS if include_optional or s.default]
