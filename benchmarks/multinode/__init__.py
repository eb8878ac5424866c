"""Simulated-cluster benchmark: does one warehouse per node scale with nodes where a central buffer does not?

``sudo .venv/bin/python -m benchmarks.multinode`` builds N = 1, 2, 4, 8
simulated nodes as network namespaces on a Linux bridge, caps every node's
link in both directions with ``tc tbf``, and runs the same GRPO iteration
(a rollout writer and reward / reference / trainer consumers on every node)
through three layouts on the same links:

- ``central``: dockd with every worker writing to node 0's warehouse, the
  conventional single buffer;
- ``distributed``: dockd with one warehouse per node, every worker writing
  to its own node's (the default home);
- ``ray``: the MindSpeed-RL style Ray-actor buffer
  (``benchmarks.peers.ray_buffer``) on node 0 of a Ray cluster with one
  raylet per node.

It reports iteration time, samples/s, the bytes through every node's link and
every warehouse, the CPU load (to show the links, not the CPUs, set the
pace), and extrapolates with an analytic model (``model``) and the measured
in-process controller (``controller_cost``) to 64 and 256 nodes.

Modules: ``netns`` (namespaces, bridge, tc, teardown), ``cluster`` (daemons,
Ray nodes, agents), ``agent`` (the per-node worker process), ``backends``
(dockd and Ray clients), ``workload`` (what the stages write and read),
``runner`` (the measurement), ``model``, ``controller_cost``, ``report``
(tables, Markdown, plot), ``config``, ``__main__`` (the command line).
"""
