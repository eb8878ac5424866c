"""Metrics reporting: the dock's Prometheus endpoint, for verl's tracking."""

from __future__ import annotations

from dockd.config import env
from dockd.trainer_plugins.verl.tq.runtime import ENV_METRICS


def get_metrics_endpoint() -> str:
    """The dock's Prometheus endpoint (``host:port``), as configured.

    dockd daemons serve metrics when started with ``dockd serve --metrics-port N`` (see
    docs/operations.md); a client cannot discover that port, so name it: ``conf.dockd.
    metrics_endpoint`` at `init`, or the ``DOCKD_METRICS_ENDPOINT`` environment variable.
    Raises RuntimeError when neither is set (TransferQueue returns None when its metrics
    are disabled; verl logs the error and registers no endpoint either way).
    """
    endpoint = env(ENV_METRICS)
    if not endpoint:
        raise RuntimeError(
            "dockd transfer_queue does not know the dock's metrics endpoint: start the daemons with "
            "`dockd serve --metrics-port PORT` (docs/operations.md) and pass the endpoint as "
            f"conf.dockd.metrics_endpoint='host:PORT' to transfer_queue.init(), or set {ENV_METRICS}=host:PORT"
        )
    return endpoint
