"""``replica_split``: which replica of a shard rank steps each role, and the transfers of gradients and weights between replicas."""
