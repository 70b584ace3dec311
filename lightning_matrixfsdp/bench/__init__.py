"""Side-by-side benchmark of Muon under data-parallel sharding (`python -m lightning_matrixfsdp.bench`).

Trains one decoder transformer under several modes (stock FSDP2 baselines,
ZeRO-1 owner placement, the DDP reference and our owner-sharded runtime) and
reports phase times, peak memory, bytes per phase and plan balance.
"""

from .config import ALL_MODES, BenchConfig, ModelConfig, OptimConfig, RunConfig, preset

__all__ = ["ALL_MODES", "BenchConfig", "ModelConfig", "OptimConfig", "RunConfig", "preset"]
