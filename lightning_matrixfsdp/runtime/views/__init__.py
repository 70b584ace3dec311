"""What the layers above see of a sharded model: the checkpoints' read-only view, the residency rule, ``state_dict`` guarded, ``full_model`` and copies."""
