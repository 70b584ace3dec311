"""Cluster descriptions for the step-time predictor (`python -m lightning_matrixfsdp.bench predict`).

A `Cluster` is what the predictor needs to know of the machines: GPUs per node and
nodes, the achieved bf16 matmul rate, how much of it the model's forward/backward and
Newton-Schulz reach, HBM bandwidth for elementwise optimizer work, collective bandwidth
and latency inside a node and between nodes, the host time DTensor spends per
collective, and the memory of one GPU.

The efficiency constants are fitted once, by `cli.calibrate`, on this
project's own H200 runs in docs/results (each constant from a named measurement, listed
in `CALIBRATION_SOURCES`); the presets carry the rounded results, and a test checks
that the fit still reproduces them. docs/benchmarks.md ("Predicted step times") says
which figures were fitted and which are checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

GIB = 2**30

# Public spec figures (dense bf16 peak, HBM, NVLink per direction, GPU memory).
H200_PEAK_TFLOPS = 989.0
H200_HBM_GBS = 4800.0
H200_NVLINK_GBS = 450.0
A100_PEAK_TFLOPS = 312.0
A100_HBM_GBS = 2039.0
A100_NVLINK_GBS = 300.0
HDR_GBS = 25.0  # one HDR InfiniBand port, 200 Gb/s

# Inputs measured on H200 and documented elsewhere: FSDP2's all-gather of one 268M-parameter
# bf16 unit over two NVLink-connected H200s (docs/how-it-works.md#bandwidth), giving the bus
# bandwidth bytes * (W-1)/W / time; and the bench's 8192^3 matmul probe, rounded over the
# calibration runs (their JSON's matmul_bf16_tflops).
H200_ALLGATHER_BYTES = 268_435_456 * 2
H200_ALLGATHER_MS = 1.11
H200_MATMUL_TFLOPS = 760.0

# Files and fields each fitted constant comes from (relative to docs/results/).
CALIBRATION_SOURCES = {
    "model_eff": "2026-11-30-h200x1-aa2fc35-onenode/bench_onenode_w1_cuda.json: forward ms, median of the six "
                 "predicted modes, over that run's matmul rate",
    "ns_eff_ours": "2026-11-30-h200x2-aa2fc35-onenode/orthogonalizers.json: 'newton_schulz (default ...)' rows, "
                   "FLOP-weighted NS-equivalent TFLOP/s over that file's matmul rate",
    "ns_eff_stock": "same file, 'newton_schulz blocks=1 (torch.optim.Muon's ops)' rows",
    "muon_bpp": "2026-11-30-h200x2-aa2fc35-onenode/owner_step_profile.json: whole step 'torch.optim.Muon + AdamW' "
                "minus 'ns only', per owned matrix element, at HBM bandwidth (AdamW part removed)",
    "adamw_bpp": "bench_onenode_w1_cuda.json: fsdp2_adamw optimizer ms per parameter at HBM bandwidth",
    "dispatch_us": "2026-11-30-h200x2-aa2fc35-onenode/bench_onenode_w2_cuda.json: fsdp2_muon optimizer ms minus "
                   "the rest of the stock model, per DTensor collective",
}


class ClusterError(ValueError):
    """A cluster description that cannot be right (non-positive rate, bandwidth, count)."""


@dataclass(frozen=True)
class Cluster:
    """One homogeneous cluster; rates in TFLOP/s, bandwidths in GB/s (1e9 B/s), latencies in us."""

    name: str
    gpus_per_node: int
    nodes: int
    matmul_tflops: float  # achieved bf16 rate of a large (8192^3) matmul
    model_eff: float  # forward/backward FLOP rate / matmul_tflops
    ns_eff_ours: float  # our Newton-Schulz (symmetric blocks) rate / matmul_tflops
    ns_eff_stock: float  # torch.optim.Muon's Newton-Schulz rate / matmul_tflops
    hbm_gbs: float
    muon_bpp: float  # effective HBM bytes per matrix element of a Muon step besides Newton-Schulz
    adamw_bpp: float  # effective HBM bytes per element of torch.optim.AdamW's step
    intra_gbs: float  # collective bus bandwidth inside a node (per GPU)
    intra_lat_us: float  # latency of one collective inside a node
    inter_gbs: float  # collective bandwidth between nodes, per node (all its NICs)
    inter_lat_us: float  # extra latency per node a ring crosses
    dispatch_us: float  # host time per DTensor collective inside stock Muon's step
    gpu_mem_gib: float

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes"):
            if int(getattr(self, key)) < 1:
                raise ClusterError(f"cluster {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        for key in ("matmul_tflops", "model_eff", "ns_eff_ours", "ns_eff_stock", "hbm_gbs", "muon_bpp",
                    "adamw_bpp", "intra_gbs", "inter_gbs", "gpu_mem_gib"):
            v = getattr(self, key)
            if not v > 0:
                raise ClusterError(f"cluster {self.name!r}: {key} must be positive, got {v}")
        for key in ("intra_lat_us", "inter_lat_us", "dispatch_us"):
            if getattr(self, key) < 0:
                raise ClusterError(f"cluster {self.name!r}: {key} must be >= 0, got {getattr(self, key)}")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_(self, **changes: Any) -> "Cluster":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------ collective costs (seconds)
    def ring_gbs(self, span: int) -> float:
        """Bus bandwidth of a collective over ``span`` consecutive ranks: NVLink inside a node;
        across nodes each ring crosses every node boundary once per byte, so the node's NICs
        (all of them, one ring per NIC) bound it."""
        return self.intra_gbs if span <= self.gpus_per_node else min(self.intra_gbs, self.inter_gbs)

    def latency(self, span: int) -> float:
        if span <= 1:
            return 0.0
        nodes = -(-span // self.gpus_per_node)
        return (self.intra_lat_us + (nodes - 1) * self.inter_lat_us) * 1e-6

    def all_gather(self, nbytes: float, span: int) -> float:
        """All-gather (or reduce-scatter) of ``nbytes`` in total over ``span`` ranks."""
        if span <= 1:
            return 0.0
        return nbytes * (span - 1) / span / (self.ring_gbs(span) * 1e9) + self.latency(span)

    def all_reduce(self, nbytes: float, span: int) -> float:
        return 2 * self.all_gather(nbytes, span) - self.latency(span) if span > 1 else 0.0

    def broadcast(self, nbytes: float, span: int) -> float:
        """A pipelined ring/tree broadcast (or reduce): every link carries the payload once."""
        if span <= 1:
            return 0.0
        return nbytes / (self.ring_gbs(span) * 1e9) + self.latency(span)

    def replica_latency(self, replicas: int) -> float:
        return (self.intra_lat_us + (replicas - 1) * self.inter_lat_us) * 1e-6 if replicas > 1 else 0.0

    def replica_all_reduce(self, nbytes: float, replicas: int) -> float:
        """A ring all-reduce across replicas (one rank per node) while every local rank runs its
        own: each of the node's GPUs gets 1/gpus_per_node of its NICs."""
        if replicas <= 1:
            return 0.0
        return 2 * (replicas - 1) / replicas * nbytes / (self.inter_gbs / self.gpus_per_node * 1e9) \
            + self.replica_latency(replicas)

    def replica_p2p(self, received: float, sent: float, replicas: int) -> float:
        """A point-to-point exchange across replicas: a GPU moves the larger of what it receives
        and sends through its share of the node's NICs."""
        if replicas <= 1:
            return 0.0
        return max(received, sent) / (self.inter_gbs / self.gpus_per_node * 1e9) + self.replica_latency(replicas)

    def replica_chain(self, received: float, sent: float, replicas: int, chunk: float, chunks: int) -> float:
        """A chunked chain across replicas (``replica_split``'s reduction): a GPU moves the larger
        of what it receives and sends through its share of the node's NICs, plus the pipeline's
        fill (``replicas - 1`` chunks) and one inter-node latency per step."""
        if replicas <= 1:
            return 0.0
        share = self.inter_gbs / self.gpus_per_node * 1e9
        return (max(received, sent) + (replicas - 1) * chunk) / share \
            + self.intra_lat_us * 1e-6 + (chunks + replicas - 1) * self.inter_lat_us * 1e-6

    def replica_broadcast(self, nbytes: float, replicas: int) -> float:
        """Pipelined broadcasts across replicas (one rank per node, every local rank at once):
        each byte crosses each GPU's share of its node's NICs about once."""
        if replicas <= 1:
            return 0.0
        return nbytes / (self.inter_gbs / self.gpus_per_node * 1e9) + self.replica_latency(replicas)


# ---------------------------------------------------------------- presets
# The H200 constants below are `cli.calibrate(docs/results)` rounded; the A100 ones reuse the
# H200 efficiencies (the same kernels and the same NCCL on another GPU) with A100 spec figures.
_H200_FIT = dict(model_eff=0.7174, ns_eff_ours=0.9764, ns_eff_stock=0.8485, muon_bpp=32.2, adamw_bpp=60.1,
                 dispatch_us=233.0)
_NCCL_EFF = H200_ALLGATHER_BYTES / 2 / (H200_ALLGATHER_MS * 1e-3) / 1e9 / H200_NVLINK_GBS


def h200(nodes: int = 1, gpus_per_node: int = 2, matmul_tflops: float = H200_MATMUL_TFLOPS) -> Cluster:
    """The measured machine: H200s on NVLink (multi-node figures: 8 x NDR 400 Gb/s assumed)."""
    return Cluster("h200", gpus_per_node, nodes, matmul_tflops, hbm_gbs=H200_HBM_GBS,
                   intra_gbs=round(_NCCL_EFF * H200_NVLINK_GBS, 1), intra_lat_us=10.0,
                   inter_gbs=round(_NCCL_EFF * 8 * 50.0, 1), inter_lat_us=10.0, gpu_mem_gib=139.0, **_H200_FIT)


def a100_ib(nodes: int = 1, gpus_per_node: int = 8, hdr_ports: int = 4) -> Cluster:
    """8 x A100-SXM4-80GB per node on NVLink (300 GB/s per direction), ``hdr_ports`` x HDR
    200 Gb/s InfiniBand per node. The matmul rate is the A100 peak times the H200's
    achieved/peak ratio of its calibration runs; NCCL efficiency as measured on NVLink."""
    mm = A100_PEAK_TFLOPS * H200_MATMUL_TFLOPS / H200_PEAK_TFLOPS
    name = "a100-ib" if hdr_ports == 4 else f"a100-ib{hdr_ports}"
    return Cluster(name, gpus_per_node, nodes, round(mm, 1), hbm_gbs=A100_HBM_GBS,
                   intra_gbs=round(_NCCL_EFF * A100_NVLINK_GBS, 1), intra_lat_us=10.0,
                   inter_gbs=round(_NCCL_EFF * hdr_ports * HDR_GBS, 1), inter_lat_us=10.0,
                   gpu_mem_gib=79.0, **_H200_FIT)


CLUSTERS = {
    "h200": h200,
    "a100-ib": a100_ib,
    "a100-ib8": lambda nodes=1, gpus_per_node=8: a100_ib(nodes, gpus_per_node, hdr_ports=8),
}


def cluster(name: str, **kw: Any) -> Cluster:
    if name not in CLUSTERS:
        raise ClusterError(f"unknown cluster preset {name!r}; known: {', '.join(CLUSTERS)}")
    return CLUSTERS[name](**kw)
