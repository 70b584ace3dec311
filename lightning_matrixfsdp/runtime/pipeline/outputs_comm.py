"""The last stage's outputs on every rank of a pipeline group (prediction under pipeline parallelism).

``PipelineRun.predict`` leaves the outputs (logits) on the ranks that run the last stage. A
prediction loop wants them where DDP would have them: on every rank, for that rank's batch. The
ranks of one pipeline group read the same batch (one data-parallel place), so the last stage's
rank sends its outputs to the others of its group: a small header (dtype and shape, which the
other stages cannot know: a head may compute in another dtype than the hidden states) and then
the tensor itself, bit for bit. Data-parallel places never exchange outputs: each keeps its own batch's.

Before the schedule runs, with more than one data-parallel place, every rank of the world learns
every rank's batch size and whether it is its loop's last batch (one all-gather of two integers;
a place whose loop has no batch at all joins it once, with none): a batch that the micro-batches
do not divide, or places whose batch counts differ, would leave some ranks in a schedule or an
all-gather the others never join; both are refused on every rank alike, naming the ranks.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.small import gather_ints
from lightning_matrixfsdp.runtime.errors import MatrixShardError, UnevenInputsError

__all__ = ["NO_BATCH", "check_places_agree", "outputs_everywhere"]

#: the dtypes an output may have (their index is the header's code)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16, torch.complex64, torch.complex128)
_MAX_DIMS = 8
#: the ``last`` a place passes whose loop has no batch at all (it meets the others' check once)
NO_BATCH = 2


def check_places_agree(run: Any, rows: int, last: Optional[Union[bool, int]]) -> None:
    """Refuse, on every rank of the world, a batch of ``rows`` the run's micro-batches do not
    divide on any rank, and (``last`` known: a loop's last-batch flag, or ``NO_BATCH``) places
    whose loops end at different batches. Collective over the world when the run has more than
    one data-parallel place (each place its own batch); local otherwise (the pipeline group
    shares one batch)."""
    m = run.microbatches
    if run.mesh.dp_size == 1:
        everyone = [[rows, -1]]
    else:
        everyone = gather_ints([rows, -1 if last is None else int(last)], None,
                               "the prediction check of batch sizes under pipeline parallelism")
    bad = [(r, n) for r, (n, _) in enumerate(everyone) if n % m]
    if bad:
        where = ", ".join(f"rank {r}: {n}" for r, n in bad) if len(everyone) > 1 else str(bad[0][1])
        raise MatrixShardError(f"under pipeline parallelism each batch is split into pipeline_microbatches={m} "
                               f"micro-batches, so its size must be a multiple of {m} (batch size {where}); use a "
                               f"batch size (and, for the last batch, a dataset size) that {m} divides, "
                               "drop_last=True, or another pipeline_microbatches")
    flags = {f for _, f in everyone if f >= 0}
    if len(flags) > 1:
        said = {0: "have more batches", 1: "are at their last batch", NO_BATCH: "have no batch at all"}
        state = "; ".join(f"rank(s) {', '.join(str(r) for r, (_, g) in enumerate(everyone) if g == f)} {said[f]}"
                          for f in sorted(flags))
        raise UnevenInputsError(
            f"under pipeline parallelism the data-parallel places have different numbers of batches ({state}); "
            "each place's stages run their forward together, so every place needs the same number of batches: "
            "use a dataset whose size is a multiple of the data-parallel size x the batch size (Lightning's "
            "prediction sampler does not pad), or limit_predict_batches to at most the smallest count")


def outputs_everywhere(run: Any, inputs: torch.Tensor) -> torch.Tensor:
    """``run.predict(inputs)`` (forward only) on every rank of this rank's pipeline group: the last
    stage's outputs for the batch, exactly as that stage computed them. Collective over the
    pipeline group (every rank of it passes the same batch)."""
    out = run.predict(inputs)
    mesh = run.mesh
    if mesh.pp_group is None or mesh.pp_size == 1:
        return out
    src = mesh.global_rank_of(run.last_place)
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=run.device)
    if out is not None:
        if out.dtype in _DTYPES and out.dim() <= _MAX_DIMS:
            header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
            header[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
        else:  # said to the whole group, which raises alike
            header[0], header[1] = -1, min(out.dim(), _MAX_DIMS)
    dist.broadcast(header, src=src, group=mesh.pp_group)
    code, ndim = int(header[0]), int(header[1])
    if code < 0:
        raise MatrixShardError(f"the pipelined model's last stage returned outputs that cannot be sent to the "
                               f"other stages of its pipeline group ({ndim} or more dims, or a dtype outside "
                               f"{', '.join(str(d) for d in _DTYPES)})")
    shape = tuple(int(s) for s in header[2:2 + ndim])
    buf = out.detach().contiguous() if out is not None else torch.empty(shape, dtype=_DTYPES[code], device=run.device)
    dist.broadcast(buf, src=src, group=mesh.pp_group)
    return buf
