"""Where a sharded model runs: ``MeshInfo`` (its groups), the device meshes and their process groups, and the ``"auto"`` choices from the topology."""
