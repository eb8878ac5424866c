"""The pieces of dockd's `transfer_queue`-compatible module (`dockd.trainer_plugins.verl.transfer_queue`).

That module is the public surface (``import transfer_queue`` resolves to it once the switch is
on); it imports its names from these modules, which import each other and nothing from it:

    meta        KVBatchMeta, BatchMeta (TransferQueue's metadata types)
    samplers    TransferQueue's samplers as settings, and the choices they make
    keylog      a TQ partition's key log: the records, and how each log entry applies
    fields      fields in (TensorDict, dict, data_parser) and out (TensorDict) of dock columns
    store       the connection to the dock: the key log, the KV calls, checkpoints of partitions
    consume     consumption and sampling on the key log (get_meta's work, statuses, resets)
    runtime     the process's connection and controller settings: init, close
    kv          the module-level KV API (kv_put ... async_kv_clear)
    client      get_client's DockTQClient (the calls verl's tqbridge makes)
    checkpoint  save_checkpoint / load_checkpoint
    streaming   StreamingDataset / StreamingDataLoader
    metrics     get_metrics_endpoint
    switch      install / uninstall: ``import transfer_queue`` here and in Ray workers
"""

FACADE = "dockd.trainer_plugins.verl.transfer_queue"
"""The module ``import transfer_queue`` resolves to; its name is also these modules' logger name."""
