"""Benchmark configuration: plain dataclasses (torchtitan style) plus named presets.

Every knob lives here so a JSON result can record the exact configuration that
produced it, and so the GPU run and the CPU test differ only by preset.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

# Run order. `muon_fsdp2` (third-party, known to crash in some settings) runs last:
# a crash on one rank can leave the shared process group timed out for later modes.
ALL_MODES: tuple[str, ...] = (
    "fsdp2_adamw",
    "fsdp2_muon",
    "fsdp2_gather_once",
    "zero1_owner",
    "ddp_muon",
    "matrix_fsdp_p2p",
    "matrix_fsdp_broadcast",
    "matrix_fsdp_padded_all_gather",
    "matrix_fsdp_p2p_packed",
    "matrix_fsdp_p2p_fast",
    "matrix_hsdp",
    "matrix_hsdp_split",
    "muon_fsdp2",
)

# Short names accepted on the command line and expanded into ALL_MODES entries.
MODE_ALIASES: dict[str, tuple[str, ...]] = {
    "all": ALL_MODES,
    "matrix_fsdp": ("matrix_fsdp_p2p", "matrix_fsdp_broadcast", "matrix_fsdp_padded_all_gather",
                    "matrix_fsdp_p2p_packed", "matrix_fsdp_p2p_fast"),
    # HSDP over run.hsdp_shard_size ranks, without and with replica_split (docs/multi-node.md)
    "hsdp": ("matrix_hsdp", "matrix_hsdp_split"),
    "baselines": ("fsdp2_adamw", "fsdp2_muon", "fsdp2_gather_once", "zero1_owner", "ddp_muon", "muon_fsdp2"),
}


@dataclass
class ModelConfig:
    """Shape of the decoder transformer trained by every mode."""

    vocab_size: int = 128
    hidden: int = 64
    n_heads: int = 4
    mlp_hidden: int = 128  # gated (SwiGLU) MLP width
    n_layers: int = 2
    seq_len: int = 32
    activation_checkpointing: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if (self.hidden // self.n_heads) % 2:
            raise ValueError("head dimension must be even for rotary embeddings")


@dataclass
class OptimConfig:
    """Hyper-parameters shared by all modes so their losses are comparable.

    Muon-family modes use `lr`/`weight_decay`/`momentum`... for matrices and the
    `adamw_*` values for everything else; `fsdp2_adamw` uses the `adamw_*` values
    for every parameter.
    """

    lr: float = 0.02
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    adamw_lr: float = 3e-3
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.0
    # "blocks": 2D weights inside the transformer blocks are Muon matrices,
    # embedding/head/norms go to AdamW (the usual Muon recipe and the setting
    # of the measured baselines). "all_2d": every 2D parameter is a matrix.
    matrix_scope: str = "blocks"

    def __post_init__(self) -> None:
        if self.matrix_scope not in ("blocks", "all_2d"):
            raise ValueError(f"matrix_scope must be 'blocks' or 'all_2d', got {self.matrix_scope!r}")
        self.ns_coefficients = tuple(self.ns_coefficients)  # type: ignore[assignment]
        self.adamw_betas = tuple(self.adamw_betas)  # type: ignore[assignment]


@dataclass
class RunConfig:
    """How the modes are run and measured."""

    modes: list[str] = field(default_factory=lambda: list(ALL_MODES))
    warmup: int = 3
    steps: int = 10
    batch_size: int = 1  # sequences per rank per step
    dtype: str = "float32"  # model (and optimizer state) dtype: float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 1234
    count_bytes: bool = True  # one extra step per mode with the byte counter on
    zero1_assignment: str = "greedy"  # greedy (by size) | round_robin (i mod W)
    planner: str = "role_greedy"  # matrix_fsdp planner
    hsdp_shard_size: int = 1  # shard span W of the matrix_hsdp modes (replicas: world // W)
    collective_timeout_s: float = 600.0  # per-mode process group timeout
    out_dir: str = "bench_out"
    plot: bool = True  # needs matplotlib (the `bench` extra)

    def __post_init__(self) -> None:
        self.modes = expand_modes(self.modes)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.zero1_assignment not in ("greedy", "round_robin"):
            raise ValueError(f"zero1_assignment must be greedy or round_robin, got {self.zero1_assignment!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("need steps >= 1 and warmup >= 0")
        if self.hsdp_shard_size < 1:
            raise ValueError(f"hsdp_shard_size must be >= 1, got {self.hsdp_shard_size}")


@dataclass
class BenchConfig:
    """The whole benchmark configuration (what goes into the JSON's `config`)."""

    preset: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchConfig":
        return cls(
            preset=d.get("preset", "custom"),
            model=ModelConfig(**d.get("model", {})),
            optim=OptimConfig(**d.get("optim", {})),
            run=RunConfig(**d.get("run", {})),
        )


def expand_modes(modes: list[str] | tuple[str, ...] | str) -> list[str]:
    """Expand aliases ("all", "matrix_fsdp", comma lists) into known mode names, in order."""
    if isinstance(modes, str):
        modes = [modes]
    out: list[str] = []
    for item in modes:
        for name in str(item).split(","):
            name = name.strip()
            if not name:
                continue
            for m in MODE_ALIASES.get(name, (name,)):
                if m not in ALL_MODES:
                    raise ValueError(f"unknown mode {m!r}; known: {', '.join(ALL_MODES)} or {', '.join(MODE_ALIASES)}")
                if m not in out:
                    out.append(m)
    if not out:
        raise ValueError("no modes selected")
    return out


def _preset_tiny() -> BenchConfig:
    # Seconds on 2 CPU processes; shapes divisible by 2 so FSDP shards are even.
    return BenchConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=128, hidden=64, n_heads=4, mlp_hidden=128, n_layers=2, seq_len=32),
        run=RunConfig(warmup=1, steps=3, batch_size=2, dtype="float32"),
    )


def _preset_small() -> BenchConfig:
    # A quick GPU sanity run or a slow-ish CPU run (~30M parameters).
    return BenchConfig(
        preset="small",
        model=ModelConfig(vocab_size=8192, hidden=512, n_heads=8, mlp_hidden=2048, n_layers=6, seq_len=512),
        run=RunConfig(warmup=2, steps=5, batch_size=2, dtype="float32"),
    )


def _preset_onenode() -> BenchConfig:
    # The 4.56B-parameter model of docs/benchmarks.md (2 x H200, bf16, AC, batch 1/rank).
    return BenchConfig(
        preset="onenode",
        model=ModelConfig(
            vocab_size=32000,
            hidden=4096,
            n_heads=32,
            mlp_hidden=16384,
            n_layers=16,
            seq_len=4096,
            activation_checkpointing=True,
        ),
        run=RunConfig(warmup=3, steps=10, batch_size=1, dtype="bfloat16", device="cuda"),
    )


PRESETS = {"tiny": _preset_tiny, "small": _preset_small, "onenode": _preset_onenode}


def preset(name: str) -> BenchConfig:
    """A fresh copy of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name]())
