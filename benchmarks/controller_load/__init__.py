"""Controller load benchmark: ``python -m benchmarks.controller_load``.

M simulated workers (``AsyncDock`` clients, many per process, several
processes) stream per-sample puts and small gets the way asynchronous RL does
against real ``dockd serve`` daemons, open loop at rising offered rates. It
reports the request rate sustained with p99 <= 10 ms, the controller and
warehouse daemons' CPU per request (``/proc/<pid>/stat``), and both against a
raw 64-byte Unix-socket and TCP echo round trip measured in the same run;
then feeds the controller's CPU per request to the streaming model
(``benchmarks.multinode.model.streaming_table``: 1,024 nodes x 8 accelerators,
K = 1, 2, 4, 8 controllers). See benchmarks/README.md.
"""
