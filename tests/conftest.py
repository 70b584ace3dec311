import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest

# Rendezvous variables an earlier in-process test may have left behind; a child launched
# with them would join (or bind) that stale rendezvous instead of starting its own.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict:
    """``os.environ`` without distributed rendezvous variables, for launching subprocesses."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="session")
def dist_pools():
    """Lazily started gloo worker pools, one per world size, shared by the session."""
    from helpers.dist import DistPool

    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if world not in pools:
            pools[world] = DistPool(world)
        return pools[world]

    yield get
    for p in pools.values():
        p.close()


@pytest.fixture(scope="session")
def hf_pool():
    """Two gloo workers shared by the Hugging Face files (test_hf, test_pretrained,
    test_export_safetensors, and the 2-process scenarios of test_moe_hf, test_moe_ep and
    test_ep_join): transformers is imported once per worker for all of them, and it stays out of
    the shared ``dist_pools``."""
    from helpers.dist import DistPool

    workers = DistPool(2)
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def hf_pool4():
    """Four gloo workers shared by the 4-process Hugging Face MoE scenarios (test_moe_ep,
    test_moe_hf): one start and one transformers import per worker for both files, and it stays
    out of the shared ``dist_pools``."""
    from helpers.dist import DistPool

    workers = DistPool(4)
    yield workers
    workers.close()
