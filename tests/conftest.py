import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture(scope="session")
def dist_pools():
    """Lazily started gloo worker pools, one per world size, shared by the session."""
    from _dist import DistPool

    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if world not in pools:
            pools[world] = DistPool(world)
        return pools[world]

    yield get
    for p in pools.values():
        p.close()
