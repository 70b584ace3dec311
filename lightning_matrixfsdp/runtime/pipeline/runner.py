"""``build_pipeline`` and ``PipelineRun``: a model split into stages, each owner-sharded over its
stage's data-parallel ranks, driven by one of torch's pipeline schedules.

Gradients over micro-batches. The loss function divides each micro-batch's loss by the number
of micro-batches ``M`` (torch's own scaling is off, ``scale_grads=False``), so the gradients
summed over the micro-batches are the mean gradient of the whole batch, as one backward of the
batch's mean loss gives them. Our runtime reduces each unit's gradients to their owners at the
end of every backward, and torch runs one backward per micro-batch: so every micro-batch is
reduced (summed over the stage's data-parallel ranks, divided by their number) and accumulated
on the owner. That is exact against an oracle that reduces every micro-batch the same way, moves
``M`` times the gradient bytes of one backward, and keeps no full gradient between micro-batches
(the runtime's no-sync accumulation, ``set_requires_gradient_sync``, would hold every stage's full
gradients on every rank until the last micro-batch; torch's schedules give no hook at a stage's
last backward to switch it back, so it is not used here).

The optimizer steps each stage's parameters where their owners are: nothing crosses stages, so
``optimizer.step()`` moves 0 bytes. A norm for clipping sums the squares of each stage's owned
gradients over its data-parallel group, then over ``pp_group`` (each parameter lives in one stage;
a tied weight's head copy holds no gradient once ``reduce_tied_grads`` ran, so clip after it).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from lightning_matrixfsdp.runtime.classify import recipe_roles
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.pipeline.comm import (
    SCHEDULES,
    PipelineMesh,
    broadcast_from_place,
    make_schedule,
    make_stage,
    schedule_class,
    stage_mesh_info,
)
from lightning_matrixfsdp.runtime.pipeline.combine import check_no_tensor_parallel, option_of, stage_dims
from lightning_matrixfsdp.runtime.pipeline.families import StageModule, family_of
from lightning_matrixfsdp.runtime.pipeline.inputs import check_inputs
from lightning_matrixfsdp.runtime.pipeline.split import StagePlan, plan_stages
from lightning_matrixfsdp.runtime.pipeline.split_backward import SplitBackward, check_split_combination
from lightning_matrixfsdp.runtime.pipeline.ties import TiedCopies, find_ties, untie_for_last_stage
from lightning_matrixfsdp.runtime.shard import matrix_shard
from lightning_matrixfsdp.runtime.tags import attach_pipeline, recipe_of, tag_recipe

__all__ = ["PipelineRun", "build_pipeline", "stage_indices"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_indices(pp_rank: int, pp_size: int, per_rank: int, order: str) -> list[int]:
    """The stages a rank runs: ``pp_rank + k * pp_size`` (loop), or ``pp_rank`` and ``2 pp_size - 1 - pp_rank`` (V)."""
    if order == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(per_rank)]


def build_pipeline(model: nn.Module, mesh: PipelineMesh, *, loss_fn: LossFn, schedule: str = "1F1B",
                   microbatches: int = 4, split: Optional[Sequence[str]] = None, stages_per_rank: Optional[int] = None,
                   family: Optional[str] = None, device: Optional[torch.device] = None, **shard_options: Any
                   ) -> "PipelineRun":
    """Split ``model`` into ``mesh.pp_size * stages_per_rank`` stages, keep this rank's, owner-shard
    each over its stage's data-parallel mesh (``matrix_shard(stage, mesh=mesh.dp_mesh, **shard_options)``)
    and drive them with torch's ``schedule`` over ``microbatches`` micro-batches.

    ``loss_fn(outputs, targets)``: the mean loss of one micro-batch (logits of the last stage).
    ``split``: the first block of each stage after the first (None: balanced by parameter count).
    ``stages_per_rank``: 1 for GPipe / 1F1B, 2 by default for the multi-stage schedules.
    ``expert_parallel_size`` (in ``shard_options``): each stage's experts split over that many of
    the stage's data-parallel ranks (combine.py); tensor parallelism is refused.
    Every check runs before anything is sharded, alike on every rank."""
    kind = SCHEDULES.get(schedule)
    check_no_tensor_parallel(mesh.pp_size, shard_options)
    ep = option_of(shard_options, "expert_parallel_size", 1)
    if kind is not None and kind.split_backward:
        check_split_combination(schedule, ep)
    dims = stage_dims(mesh.pp_size, mesh.dp_size, mesh.shard_size, ep) if ep != 1 else None
    schedule_class(schedule)  # unknown, or missing in this torch: refused here
    per_rank = stages_per_rank or (2 if kind.multi else 1)
    if not kind.multi and per_rank != 1:
        raise MatrixShardError(f"pipeline schedule {schedule!r} runs one stage per rank; stages_per_rank={per_rank} "
                               "needs a multi-stage schedule such as 'Interleaved1F1B'")
    if kind.order == "v" and per_rank != 2:
        raise MatrixShardError(f"pipeline schedule {schedule!r} runs two stages per rank (a V); got "
                               f"stages_per_rank={per_rank}")
    if microbatches < 1:
        raise MatrixShardError(f"pipeline_microbatches must be at least 1, got {microbatches}")
    fam = family_of(model, family)
    blocks = fam.blocks(model)
    modules = {n for n, _ in model.named_modules()}
    count = lambda names: sum(p.numel() for p in _params_of(model, names))  # noqa: E731
    plan = plan_stages([(b, count([b])) for b in blocks], count(fam.pre), count(fam.post), mesh.pp_size * per_rank,
                       split, modules)
    keeps = [fam.keep(model, span) for span in plan.stages]
    ties = find_ties(model, keeps, mesh, per_rank)
    check_placement(model, keeps, {id(model.get_parameter(t.first)) for t in ties})
    dtype = shard_options.get("param_dtype") or next(p.dtype for p in model.parameters() if p.is_floating_point())
    for fqn, choice in recipe_roles(model).items():  # the Muon recipe of the whole model, before it is split
        p = model.get_parameter(fqn)
        if recipe_of(p) is None:
            tag_recipe(p, choice)
    # each block one unit, as matrix_shard picks them in the unsplit model (a stage has no ModuleList)
    blocks_policy = {type(model.get_submodule(b)) for b in blocks}
    config = shard_options.get("config")
    if config is not None and config.wrap_policy is None:
        shard_options["config"] = config.updated(wrap_policy=blocks_policy)
    elif config is None and shard_options.get("wrap_policy") is None:
        shard_options["wrap_policy"] = blocks_policy
    mine = stage_indices(mesh.pp_rank, mesh.pp_size, per_rank, kind.order)
    if ties and plan.num_stages - 1 in mine:
        untie_for_last_stage(model, ties)  # the head's own copy; the embedding's owner steps the weight
    # expert parallelism: every stage's groups, created once on every rank (all stages of a rank share them)
    shard_mesh = stage_mesh_info(mesh, dims) if dims is not None else mesh.dp_mesh
    stages = []
    for index in mine:
        stage = StageModule(model, plan.stages[index], keeps[index], fam)
        stages.append(matrix_shard(stage, mesh=shard_mesh, device=device, **shard_options))
    device = torch.device(device) if device is not None else next(stages[0].parameters()).device
    run = PipelineRun(stages, mine, plan, mesh, schedule, microbatches, loss_fn, device, dtype)
    if ties:  # collective: every rank has the same ties (from the model's structure)
        run.tied = TiedCopies(ties, dict(run.named_parameters()), mesh, run.stages)
    attach_pipeline(model, run)  # checkpoints of ``model`` find this rank's stages (checkpoint/, global names)
    return run


def _params_of(model: nn.Module, names: Sequence[str]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for n in names:
        try:
            module = model.get_submodule(n)
        except AttributeError:
            continue
        seen.update((id(p), p) for p in module.parameters())
    return list(seen.values())


def check_placement(model: nn.Module, keeps: list[list[str]], tied: set[int] = frozenset()) -> None:
    """Every parameter of ``model`` in exactly one stage, but the ``tied`` ones (ids: shared by the
    first and the last stage, ties.py): refuses one no stage holds and one two stages share."""
    where: dict[int, set[int]] = {}
    for s, names in enumerate(keeps):
        for p in _params_of(model, names):
            where.setdefault(id(p), set()).add(s)
    names = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    for pid, fqns in names.items():
        stages = sorted(where.get(pid, ()))
        if not stages:
            raise MatrixShardError(f"parameter {fqns[0]!r} is in no pipeline stage (the family places the "
                                   "embeddings, the blocks, and the final norm and head); move it into one of them")
        if len(stages) > 1 and pid not in tied:
            raise MatrixShardError(
                f"parameter {' = '.join(fqns)} is shared by pipeline stages {stages}; only a weight tied between "
                "the first stage's embedding and the last stage's head is supported: untie it (Hugging Face: "
                "tie_word_embeddings=False) or train without pipeline parallelism")


class PipelineRun:
    """This rank's stages of a pipelined model and the schedule that runs them.

    ``step(inputs, targets)`` runs forward and backward of every micro-batch and returns the
    batch's loss (the mean over micro-batches) on every rank; the gradients then sit on their
    owners, ready for the optimizer (built over :attr:`module`, e.g. ``Muon(run.module)``).
    ``evaluate`` and ``predict`` are forward-only. Every rank passes the batch of its
    data-parallel place (the first stage reads the inputs, the last stage the targets; the
    others use only their shape)."""

    def __init__(self, stages: list[StageModule], indices: list[int], plan: StagePlan, mesh: PipelineMesh,
                 schedule: str, microbatches: int, loss_fn: LossFn, device: torch.device,
                 activation_dtype: torch.dtype) -> None:
        self.module = nn.ModuleList(stages)
        self.stage_indices = tuple(indices)
        self.plan, self.mesh, self.schedule = plan, mesh, schedule
        self.microbatches, self.loss_fn, self.device = microbatches, loss_fn, device
        self.activation_dtype = activation_dtype
        #: what each micro-batch's loss is divided by (``microbatches``): the gradient scaling
        self.loss_divisor = microbatches
        self._schedules: dict[tuple, Any] = {}
        #: split-backward schedules: each later stage's driver (split_backward.py), by stage index
        self._split: dict[int, SplitBackward] = {}
        self._losses: list[torch.Tensor] = []
        self._accumulation = 1
        #: weights tied between the first and the last stage (ties.py), None without
        self.tied: Optional[TiedCopies] = None
        order = SCHEDULES[schedule].order
        #: the pipeline place whose rank runs the last stage
        self.last_place = 0 if order == "v" else mesh.pp_size - 1

    # ------------------------------------------------------------------ what a stage holds
    @property
    def stages(self) -> list[StageModule]:
        return list(self.module)

    @property
    def pp_group(self) -> Any:
        """The pipeline group (ranks of this data-parallel place in every stage): where per-stage
        sums (a gradient norm's squares) are summed over stages."""
        return self.mesh.pp_group

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_indices

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stages' parameters under their global names (the whole model's)."""
        for stage in self.module:
            yield from stage.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def global_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    def train(self, mode: bool = True) -> "PipelineRun":
        self.module.train(mode)
        return self

    def reduce_tied_grads(self) -> None:
        """Before ``optimizer.step()``: each weight tied between the first and the last stage gets
        the sum of both copies' gradients on the embedding's owner (ties.py). No-op without ties."""
        if self.tied is not None:
            self.tied.reduce_grads()

    def sync_tied_weights(self) -> None:
        """After ``optimizer.step()``: the stepped tied weights reach the last stage's copies. No-op without ties."""
        if self.tied is not None:
            self.tied.sync_weights()

    # ------------------------------------------------------------------ running
    def _check_batch(self, inputs: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        check_inputs(self, inputs, targets)  # on every rank alike, before any schedule runs (inputs.py)

    def _split_parts(self, stage: StageModule, index: int) -> Optional[SplitBackward]:
        """A split backward (zero bubble, DualPipeV): the driver of every stage but the first (whose
        input part torch skips: its weight part is a whole backward, as under any schedule)."""
        if not SCHEDULES[self.schedule].split_backward or stage.pipeline.span.first:
            return None
        if index not in self._split:
            self._split[index] = SplitBackward(stage, index)
        return self._split[index]

    def _schedule_for(self, inputs: torch.Tensor, train: bool) -> Any:
        key = (tuple(inputs.shape), inputs.dtype, train)
        kind = SCHEDULES[self.schedule]
        if key not in self._schedules:
            tokens = torch.Size((inputs.shape[0] // self.microbatches, *inputs.shape[1:]))
            stages = []
            for stage, index in zip(self.module, self.stage_indices):
                span = stage.pipeline.span
                # hidden states between stages carry gradients (torch derives the gradient buffers from this)
                meta_in = torch.empty(stage.input_shape(tokens), device="meta",
                                      dtype=inputs.dtype if span.first else self.activation_dtype,
                                      requires_grad=train and not span.first)
                meta_out = torch.empty(stage.output_shape(tokens), device="meta", dtype=self.activation_dtype,
                                       requires_grad=train)
                stages.append(make_stage(stage, index, self.plan.num_stages, self.device, self.mesh, meta_in, meta_out,
                                         self._split_parts(stage, index) if train else None, kind.order == "v"))
            self._schedules[key] = make_schedule(self.schedule, stages, self.microbatches,
                                                 self._scaled_loss if train else None)
        return self._schedules[key]

    def _scaled_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(outputs, targets)
        self._losses.append(loss.detach())
        return loss / (self.loss_divisor * self._accumulation)

    def _run(self, schedule: Any, inputs: torch.Tensor, targets: Optional[torch.Tensor]) -> Any:
        args = (inputs.to(self.device),) if self.holds_first else ()
        kwargs = {"target": targets.to(self.device)} if self.holds_last and targets is not None else {}
        return schedule.step(*args, **kwargs)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, accumulation: int = 1) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``(inputs, targets)``; the gradients
        accumulate on the owners (``.grad``, added to what is there, as ``backward()`` does).
        ``accumulation``: the batches whose gradients are summed before the optimizer steps
        (Lightning's ``accumulate_grad_batches``): each micro-batch's loss is then divided by
        ``microbatches * accumulation``, so the window's gradient is its mean gradient.
        Returns the mean loss over the micro-batches (unscaled), on every rank of the pipeline group."""
        if targets is None:
            raise MatrixShardError("a pipelined training step needs the targets for the last stage's loss")
        if not isinstance(accumulation, int) or accumulation < 1:
            raise MatrixShardError(f"accumulation must be a positive int, got {accumulation!r}")
        self._check_batch(inputs, targets)
        schedule = self._schedule_for(inputs, train=True)
        self._losses.clear()
        self._accumulation = accumulation
        self._run(schedule, inputs, targets)
        mean = torch.stack(self._losses).mean() if self.holds_last else None
        self._losses.clear()
        return broadcast_from_place(mean, self.mesh, self.last_place, self._loss_like())

    def _loss_like(self) -> torch.Tensor:
        """The reported loss on every rank: float64 whatever the last stage's loss dtype (which the
        other ranks cannot know; torch's default dtype, which Lightning's 64-true / bf16-true change
        around a step, need not be it), so the broadcast is exact and alike on every rank."""
        return torch.zeros((), dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """Forward only: the last stage's outputs (logits) of the whole batch on the ranks that run
        it, None elsewhere."""
        self._check_batch(inputs, None)
        out = self._run(self._schedule_for(inputs, train=False), inputs, None)
        return out if self.holds_last else None

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only: the mean over micro-batches of ``loss_fn`` (as ``step`` computes it, without
        gradients), on every rank of the pipeline group."""
        self._check_batch(inputs, targets)
        outputs = self.predict(inputs)
        mean = None
        if outputs is not None:
            with torch.no_grad():
                pairs = zip(outputs.chunk(self.microbatches), targets.to(self.device).chunk(self.microbatches))
                mean = torch.stack([self.loss_fn(o, t) for o, t in pairs]).mean()
        return broadcast_from_place(mean, self.mesh, self.last_place, self._loss_like())
