"""The batch a pipelined step, evaluation or prediction is given, checked on every rank before any
schedule runs.

A schedule fails badly on a batch it cannot split: a wrong shape surfaces as a torch error deep
inside one stage (its loss function on the last stage, a shape mismatch in a point-to-point
receive) while the other stages wait for it, until the process-group timeout. So each rank first
checks its own batch (one tensor of token ids, ``(batch, sequence)``, a batch that the
micro-batches divide, targets of as many rows) and, on the ranks that run the last stage, calls
the loss function once on zero logits of one micro-batch's shape, for each new shape (is it a
scalar, does it accept these targets). Then every rank learns every rank's verdict, batch shape
and a checksum of its batch (one all-gather of a few integers over the world per call), and all
raise the same error where any rank found one, or where the ranks of one pipeline group (one
data-parallel place) hold different batches: the first stage would read one batch while the last
computes the loss against another's targets. Different data-parallel places may hold batches of
different sizes, as under DDP (each place's mean loss weighs alike).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_matrixfsdp.runtime.comm.small import gather_ints
from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["check_inputs"]

#: verdict codes, gathered as integers (every rank words the message from them)
OK, NOT_TENSOR, NOT_TOKENS, NOT_2D, NOT_DIVISIBLE, TARGETS, TARGET_ROWS, LOSS_FAILED, LOSS_NOT_SCALAR = range(9)

_WHAT = {
    NOT_TENSOR: "the inputs are not one tensor (a dict, tuple or list: input ids with an attention mask, or "
                "several inputs). A pipelined model takes token ids only: its stages attend causally over every "
                "position without a mask, so pass `batch['input_ids']` as the inputs; right padding (pads after the "
                "text, their targets -100) gives the loss a mask would, left padding or packed sequences need a "
                "mask and cannot be pipelined: use pipeline_parallel_size=1 for them",
    NOT_TOKENS: "the inputs are not integer token ids (the first stage looks them up in its embedding); pass "
                "token ids (torch.long), not embeddings or floats",
    NOT_2D: "the inputs are not (batch, sequence) token ids; pass a 2-D tensor, one row per sequence",
    NOT_DIVISIBLE: "the batch size is not a multiple of pipeline_microbatches={m} (micro-batches of unequal size "
                   "would weigh the mean loss unevenly); use a batch size that the micro-batches divide (and "
                   "drop_last=True, or a dataset size that the batch size divides), or another "
                   "pipeline_microbatches",
    TARGETS: "the targets are not one tensor; pass the targets as one tensor (e.g. the token ids shifted by one)",
    TARGET_ROWS: "the targets do not have one row per input row (the schedule splits both into micro-batches "
                 "along the first dimension)",
    LOSS_FAILED: "the loss function failed on the last stage's logits of one micro-batch and its targets (a "
                 "targets shape or dtype that does not match the logits?)",
    LOSS_NOT_SCALAR: "the loss function returned no scalar for one micro-batch; loss_fn(outputs, targets) must "
                     "return the micro-batch's mean loss (e.g. reduction='mean')",
}


def check_inputs(run: Any, inputs: Any, targets: Optional[Any]) -> None:
    """Refuse, on every rank alike, a batch ``run`` (a ``PipelineRun``) cannot pipeline.
    ``targets``: None for a prediction. Collective over the world (every rank calls it with its batch)."""
    code, detail = _local_verdict(run, inputs, targets)
    shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else ()
    rows, seq = (list(shape) + [-1, -1])[:2]
    mine = [code, rows, seq, _checksum(inputs if code == OK else None), _checksum(targets if code == OK else None)]
    mesh = run.mesh
    everyone = [mine] if mesh.pp_group is None else gather_ints(mine, None, "the check of a pipelined batch")
    bad = [(r, row[0]) for r, row in enumerate(everyone) if row[0] != OK]
    if bad:
        first = bad[0][1]
        ranks = ", ".join(str(r) for r, c in bad if c == first)
        what = "step or evaluation" if targets is not None else "prediction"
        note = f" (here: {detail})" if detail and code == first else ""
        cause = _WHAT[first].format(m=run.microbatches)
        raise MatrixShardError(f"a pipelined {what} cannot run this batch: {cause}; found on rank(s) {ranks}{note}")
    _check_groups_agree(everyone, mesh.dp_size)


def _local_verdict(run: Any, inputs: Any, targets: Optional[Any]) -> tuple[int, str]:
    """This rank's verdict on its own batch: (code, what it saw)."""
    if not isinstance(inputs, torch.Tensor):
        return NOT_TENSOR, f"inputs of type {type(inputs).__name__}"
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        return NOT_TOKENS, f"inputs of dtype {inputs.dtype}"
    if inputs.dim() != 2:
        return NOT_2D, f"inputs of shape {tuple(inputs.shape)}"
    m = run.microbatches
    if inputs.shape[0] % m:
        return NOT_DIVISIBLE, f"batch size {inputs.shape[0]}, pipeline_microbatches={m}"
    if targets is None:
        return OK, ""
    if not isinstance(targets, torch.Tensor):
        return TARGETS, f"targets of type {type(targets).__name__}"
    if targets.dim() < 1 or targets.shape[0] != inputs.shape[0]:
        return TARGET_ROWS, f"targets of shape {tuple(targets.shape)} for inputs of shape {tuple(inputs.shape)}"
    return _try_loss(run, inputs, targets)


def _try_loss(run: Any, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, str]:
    """On a rank that runs the last stage: ``loss_fn`` on zero logits of one micro-batch's shape and
    the first micro-batch's targets, once per shape (kept on the run), so that a loss function that
    cannot take these targets fails here, where every rank hears of it, not inside the schedule."""
    last = [s for s, i in zip(run.module, run.stage_indices) if i == run.plan.num_stages - 1]
    if not last:
        return OK, ""
    m = run.microbatches
    key = (tuple(inputs.shape), tuple(targets.shape), targets.dtype)
    tried: set = run.__dict__.setdefault("_tried_loss_shapes", set())
    if key in tried:
        return OK, ""
    tokens = torch.Size((inputs.shape[0] // m, *inputs.shape[1:]))
    logits = torch.zeros(last[0].output_shape(tokens), dtype=run.activation_dtype, device=run.device)
    try:
        with torch.no_grad():
            loss = run.loss_fn(logits, targets[: tokens[0]].to(run.device))
    except Exception as err:  # noqa: BLE001 - any failure is the user's loss on these targets: said on every rank
        return LOSS_FAILED, f"{type(err).__name__}: {err}; logits {tuple(logits.shape)}, targets " \
                            f"{tuple(targets[: tokens[0]].shape)} {targets.dtype}"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        return LOSS_NOT_SCALAR, f"loss_fn returned {got}"
    tried.add(key)
    return OK, ""


def _checksum(t: Optional[Any]) -> int:
    """A position-weighted sum of ``t``'s bits (0 for None): equal batches give equal sums, and two
    different batches almost never do."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(torch.uint8)  # the bits, whatever the dtype
    flat = flat.to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
    return (int((flat * weights).sum().item()) + flat.numel()) % (1 << 62)  # fits the int64 all-gather


def _check_groups_agree(everyone: list[list[int]], places: int) -> None:
    """The ranks of one pipeline group (one data-parallel place: ``rank % places``) hold one batch."""
    for place in range(places):
        members = [(r, row) for r, row in enumerate(everyone) if r % places == place]
        shapes = {tuple(row[1:3]) for _, row in members}
        sums = {tuple(row[3:5]) for _, row in members}
        if len(shapes) > 1 or len(sums) > 1:
            seen = "; ".join(f"rank {r}: batch {row[1]} x {row[2]}" + ("" if len(shapes) > 1 else
                             f", checksums {row[3]}/{row[4]}") for r, row in members)
            raise MatrixShardError(
                "the ranks of one pipeline group (the stages of one data-parallel place) were given different "
                f"batches ({seen}): the first stage would read one batch and the last compute the loss against "
                "another's targets. Every rank must pass its data-parallel place's batch: sample by place "
                "(the Trainer's sampler does with use_distributed_sampler=True; a custom sampler takes "
                "strategy.distributed_sampler_kwargs), not by global rank")
