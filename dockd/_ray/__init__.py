"""The parts behind `dockd.ray` (the public module); see its docstring for the actor layout.

    common    Ray imported on first use, actor names, lookups of named actors and nodes
    actors    DaemonActor (owns one `dockd serve` on its node) and the exec wrapper that ties
              a daemon's life to its actor's
    query     finding the running dock: find, warehouses, token, node_warehouse, home_for
              (never starts anything; the client uses home_for, so nothing here imports it)
    starting  starting daemon actors: the controller, a warehouse on every node without one,
              retiring warehouses of an earlier controller
    watcher   the Watcher actor that starts warehouses on nodes that join later

Imports point down this list's dependency order: common <- actors, query <- starting <- watcher
<- dockd.ray.
"""
