"""Pipeline parallelism in Lightning (issue 38): the contract and what the strategies do under it.

The contract (docs/pipeline-parallel.md, "Pipeline parallelism in Lightning: the contract"):
the LightningModule defines ``loss_fn(outputs, targets)`` (a method, or a loss module as an
attribute) and its steps call ``forward_loss(self, inputs, targets)``. Without pipeline
parallelism (any strategy, DDP included) that is exactly ``self.loss_fn(self(inputs), targets)``.
Under ``pipeline_parallel_size > 1`` the strategy has attached a :class:`PipelineSession` to the
module: in training ``forward_loss`` runs the schedule (forward and backward of every
micro-batch) and returns the batch's mean loss, detached, the same on every rank of the pipeline
group; the strategy's ``backward`` then runs none of its own. In evaluation it runs the forward
only. Outputs (a ``predict_step``'s) come from ``forward_outputs(self, inputs)``: exactly
``self(inputs)`` without pipeline parallelism; under it the forward schedule, whose last stage's
outputs reach every rank of the pipeline group. The session also guards the pipelined model's
whole forward, which no rank can run.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.config import SHARD, MatrixFSDPConfig
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.pipeline import FAMILIES, PipelineMesh, PipelineRun, build_pipeline, family_of
from lightning_matrixfsdp.runtime.pipeline.outputs_comm import NO_BATCH, check_places_agree, outputs_everywhere
from lightning_matrixfsdp.runtime.queries import pipeline_forwards, wait_replicas
from lightning_matrixfsdp.runtime.tags import is_owned
from lightning_matrixfsdp.runtime.tags import pipeline_of as run_of

__all__ = ["PipelineSession", "check_pipeline_world", "check_pipelined_trainer", "find_pipelined", "forward_loss",
           "forward_outputs", "holds_pipeline", "microbatches_of", "pipeline_of", "predicting_loader",
           "setup_pipeline"]

_ATTR = "_mfsdp_pipeline"
CONTRACT = ("define loss_fn(self, outputs, targets) on the LightningModule and compute the loss in training_step / "
            "validation_step as `loss = lightning_matrixfsdp.forward_loss(self, inputs, targets)` "
            "(docs/pipeline-parallel.md, 'Pipeline parallelism in Lightning: the contract')")
OUTPUTS = "for the model's outputs (predict_step) call `outputs = lightning_matrixfsdp.forward_outputs(self, inputs)`"


def _loss_fn(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    fn = getattr(module, "loss_fn", None)
    if not callable(fn):
        raise AttributeError(f"forward_loss needs {type(module).__name__}.loss_fn(outputs, targets) (a method, or a "
                             "loss module such as nn.CrossEntropyLoss() as an attribute): the loss of the model's "
                             "outputs, which pipeline parallelism computes on the last stage")
    return fn


def forward_loss(module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of ``module`` on ``(inputs, targets)``, the same code under every strategy.

    Without pipeline parallelism: exactly ``module.loss_fn(module(inputs), targets)``. Under
    ``MatrixFSDPStrategy(pipeline_parallel_size=PP > 1)`` (or the Fabric strategy), in training
    (``module.training`` and gradients enabled): runs the pipeline schedule, the forward and
    backward of every micro-batch, and returns the batch's mean loss (the mean of the
    micro-batches' ``loss_fn``), detached, on every rank; the strategy's backward of that loss
    then does nothing (the gradients are there already). In evaluation: the forward only, the
    same mean loss. Call it once per training step."""
    session = pipeline_of(module)
    if session is None:
        return _loss_fn(module)(module(inputs), targets)
    return session.loss(inputs, targets)


def forward_outputs(module: nn.Module, inputs: torch.Tensor) -> Any:
    """The outputs of ``module`` on ``inputs`` (a ``predict_step``'s), the same code under every strategy.

    Without pipeline parallelism: exactly ``module(inputs)``. Under
    ``MatrixFSDPStrategy(pipeline_parallel_size=PP > 1)`` (or the Fabric strategy): runs the
    forward schedule over the batch (its size must be a multiple of ``pipeline_microbatches``)
    and returns the last stage's outputs (the pipelined model's: logits), the same tensor on every
    rank of the pipeline group; each data-parallel place gets those of its own batch, as DDP
    would. Forward only: call it where gradients are off (validation, test and predict steps, or
    under ``torch.no_grad()``); a training loss comes from :func:`forward_loss`."""
    session = pipeline_of(module)
    if session is None:
        return module(inputs)
    return session.outputs(inputs)


def pipeline_of(module: Optional[nn.Module]) -> Optional["PipelineSession"]:
    """The pipeline session the strategy attached to ``module`` (None: no pipeline parallelism)."""
    return None if module is None else getattr(module, _ATTR, None)  # also through Fabric's module wrapper


def holds_pipeline(module: nn.Module) -> bool:
    """Whether ``module`` is, or holds, a model split into pipeline stages on this rank (a checkpoint
    of it covers every stage under the whole model's names)."""
    return any(run_of(m) is not None for m in module.modules())


def microbatches_of(config: MatrixFSDPConfig) -> int:
    """``pipeline_microbatches``, or its default: twice the pipeline size (a bubble of about
    (PP - 1) / (3 PP - 1) of a 1F1B step, and batches that need only be a multiple of 2 PP)."""
    return config.pipeline_microbatches or 2 * config.pipeline_parallel_size


def check_pipeline_world(config: MatrixFSDPConfig, world: int, tp: int, where: str) -> Optional[int]:
    """Each stage's data-parallel size for ``world`` processes (None without pipeline parallelism);
    refuses a pipeline size that does not divide the world, a ``shard_size`` that does not divide
    a stage's ranks, an ``expert_parallel_size`` that does not divide them, and tensor parallelism
    ("auto" resolved) beside it. Pure."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return None
    if tp > 1:
        raise MatrixShardError(f"pipeline_parallel_size={pp} with tensor_parallel_size={tp} ({where}) is not "
                               "supported yet; use one of them")
    if world % pp:
        raise MatrixShardError(f"pipeline_parallel_size={pp} must divide the world size {world} ({where}); use a "
                               f"divisor of {world}, or a world whose size is a multiple of {pp}")
    dp = world // pp
    if config.shard_size is not None and dp % config.shard_size:
        raise MatrixShardError(f"shard_size={config.shard_size} must divide each pipeline stage's data-parallel size "
                               f"{dp} (world {world} / pipeline_parallel_size {pp}, {where})")
    ep = config.expert_parallel_size
    if dp % ep:  # each stage splits its own experts over its own ranks (tokens never cross stages)
        raise MatrixShardError(f"expert_parallel_size={ep} must divide each pipeline stage's data-parallel size {dp} "
                               f"(world {world} / pipeline_parallel_size {pp}, {where}); use a divisor of {dp}, or "
                               f"a world of pipeline_parallel_size x a multiple of {ep} processes")
    return dp


def check_pipelined_trainer(module: Any, trainer: Any) -> None:
    """What the Trainer cannot do under pipeline parallelism, refused before the split (on every
    rank alike: each reads the same module and Trainer): manual optimization. Prediction
    (``forward_outputs``) and checkpoints (the model's global names) work; docs/pipeline-parallel.md."""
    if not module.automatic_optimization:
        raise MatrixShardError("manual optimization (automatic_optimization = False) is not supported under "
                               "pipeline parallelism: the backward runs inside the pipeline schedule, not in "
                               f"manual_backward; use automatic optimization and {CONTRACT}, or set "
                               "pipeline_parallel_size=1")


def find_pipelined(module: nn.Module) -> tuple[str, nn.Module]:
    """(name, module): the first module inside ``module`` (itself included) that a pipeline family
    recognizes (the demos' GPT, Hugging Face decoder causal LMs); refuses when there is none."""
    for name, sub in module.named_modules():
        if any(f.matches(sub) for f in FAMILIES):
            family_of(sub)  # refuses one its family cannot pipeline, saying why
            return name, sub
    known = ", ".join(f.name for f in FAMILIES)
    raise MatrixShardError(f"pipeline_parallel_size > 1 but {type(module).__name__} holds no model that pipeline "
                           f"parallelism knows how to split (known: {known}); hold such a model as a submodule "
                           "(e.g. self.model = LlamaForCausalLM(config)), or set pipeline_parallel_size=1")


class PipelineSession:
    """The pipelined run of one LightningModule and the state of its current step."""

    def __init__(self, run: PipelineRun, name: str, accumulation: Callable[[], int],
                 training: Callable[[], bool], last_batch: Callable[[], Optional[bool]] = lambda: None) -> None:
        self.run, self.name, self.accumulation, self.training = run, name, accumulation, training
        #: whether the running evaluation loop's batch is its last (None: unknown, as under Fabric):
        #: ``forward_outputs`` refuses places whose batch counts differ before any schedule runs
        self.last_batch = last_batch
        #: the loss of the step whose backward the schedule already ran (the strategy's backward takes it)
        self.pending: Optional[torch.Tensor] = None
        #: the gradients the schedule produced in this step, (parameter, gradient), added in ``take_backward``
        self._grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        #: a backward ran since the tied weights' gradients were last summed (``before_step``)
        self._ties_due = False

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``forward_loss`` under pipeline parallelism (outside a loop's steps, after the lone-forward check)."""
        with pipeline_forwards(self.run.stages):
            return self._loss(inputs, targets)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.training():
            if self.pending is not None:
                raise MatrixShardError("forward_loss ran twice in one training step under pipeline parallelism; "
                                       "each call runs a whole schedule with its backward: call it once and "
                                       "return its loss")
            # Lightning divides the step's loss by accumulate_grad_batches before its backward: the
            # micro-batches' losses are divided by it too (the schedule's backward is the only one)
            accumulation = self.accumulation()
            # Lightning zeroes the gradients between training_step and backward (the first batch of an
            # accumulation window): the schedule's gradients wait aside and join .grad in backward
            params = list(self.run.parameters())
            before = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                self.pending = self.run.step(inputs, targets, accumulation=accumulation)
                self._grads = [(p, p.grad) for p in params if p.grad is not None]
            finally:
                for p, g in zip(params, before):
                    p.grad = g
            return self.pending
        return self.run.evaluate(inputs, targets)

    def outputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """``forward_outputs`` under pipeline parallelism: the last stage's outputs on every rank
        of the pipeline group. Every rank checks the batch sizes (and, in a Trainer loop, the
        places' batch counts) before any schedule runs, so a refusal reaches every rank."""
        if torch.is_grad_enabled():
            raise MatrixShardError("forward_outputs under pipeline parallelism runs the forward only and returns "
                                   "outputs without gradients; call it where gradients are off (validation, test "
                                   "and predict steps, or under torch.no_grad()), and compute a training loss "
                                   f"with forward_loss: {CONTRACT}")
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 1:
            raise MatrixShardError(f"forward_outputs under pipeline parallelism takes the batch's inputs as one "
                                   f"tensor (token ids), got {type(inputs).__name__}")
        with pipeline_forwards(self.run.stages):  # a hook's call on some ranks only: refused within seconds
            check_places_agree(self.run, int(inputs.shape[0]), self.last_batch())
            return outputs_everywhere(self.run, inputs)

    def take_backward(self, loss: Optional[torch.Tensor] = None) -> None:
        """The strategy's backward: the schedule ran it; refuses a loss that did not come from
        ``forward_loss`` in this step (``loss``: checked to be that very tensor, under Fabric)."""
        pending, self.pending = self.pending, None
        if pending is None:
            raise MatrixShardError("under pipeline parallelism the backward runs inside forward_loss; this step's "
                                   f"loss did not come from it: {CONTRACT}")
        if loss is not None and loss is not pending:
            raise MatrixShardError("under pipeline parallelism pass the loss exactly as forward_loss returned it to "
                                   "backward (its backward ran inside forward_loss; a scaled copy would not scale "
                                   "the gradients)")
        grads, self._grads = self._grads, []
        with torch.no_grad():
            for p, g in grads:  # as backward() adds into .grad
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._ties_due = True

    def before_step(self) -> None:
        """After the backward(s) of a step, before the clip and ``optimizer.step()``: each weight tied
        between the first and the last stage gets both copies' gradients on the embedding's owner
        (once per step, however many batches were accumulated: the sum is linear). Every rank of
        the pipeline calls it at the same point of its loop (a collective between tie owners)."""
        if self._ties_due:
            self._ties_due = False
            self.run.reduce_tied_grads()

    def then_before_step(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's closure (the step's forward and backward), then :meth:`before_step`: inside
        the optimizer's step, before Lightning clips the gradients."""
        def run() -> Any:
            out = closure()
            self.before_step()
            return out
        return run

    def after_step(self) -> None:
        """After ``optimizer.step()``: the stepped tied weights reach the last stage's copies."""
        self.run.sync_tied_weights()


def _guard(name: str) -> Callable[..., Any]:
    def refuse(module: nn.Module, args: Any) -> None:
        where = f"the pipelined model ({name or 'the LightningModule itself'}, {type(module).__name__})"
        raise MatrixShardError(f"under pipeline parallelism no rank holds the whole model, so {where} cannot run "
                               f"its forward (self(...) in a step, or a hook); {CONTRACT}; {OUTPUTS}. "
                               "Reading intermediate activations needs pipeline_parallel_size=1")
    return refuse


def setup_pipeline(module: nn.Module, config: MatrixFSDPConfig, mesh: PipelineMesh, device: torch.device,
                   accumulation: Callable[[], int], checkpointing: Callable[[nn.Module, Any], None]) -> PipelineSession:
    """Split the pipelined model inside ``module`` into stages, owner-shard this rank's over its
    stage's ranks (``build_pipeline``), free the parameters of the other stages (empty and not
    owned: an optimizer built from the module drops them) and attach the session. ``checkpointing``:
    applies ``activation_checkpointing_policy`` to the pipelined model first."""
    _loss_fn(module)  # refused before anything changes
    name, sub = find_pipelined(module)
    outside = [n for n, p in module.named_parameters() if not _inside(n, name)]
    if outside:
        raise MatrixShardError(f"parameter {outside[0]!r} lies outside the pipelined model {name or '(the module)'!r}; "
                               "under pipeline parallelism every parameter must belong to a stage")
    prefix = f"{name}." if name else ""
    split = [s[len(prefix):] if prefix and s.startswith(prefix) else s for s in config.pipeline_split or ()]
    shard = {n: getattr(config, n) for n in MatrixFSDPConfig.names(SHARD) if n not in ("shard_size", "wrap_policy")}
    if config.wrap_policy is not None:
        shard["wrap_policy"] = config.wrap_policy
    checkpointing(sub, config.activation_checkpointing_policy)
    run = build_pipeline(sub, mesh, loss_fn=lambda o, t: _loss_fn(module)(o, t), schedule=config.pipeline_schedule,
                         microbatches=microbatches_of(config), split=split or None, device=device, **shard)
    mine = {id(p) for p in run.parameters()}
    for p in module.parameters():
        if id(p) not in mine:  # another stage's: no memory here, and not this rank's to step
            p.data = torch.empty(0, dtype=p.dtype, device=device)
            setattr(p, "_mfsdp_owned", False)
    assert all(not is_owned(p) or id(p) in mine for p in module.parameters())
    sub.register_forward_pre_hook(_guard(name))
    # replica_split (HSDP in a stage): the stages are roots outside the model, so their own state_dict
    # hooks do not run for the model's; a state read (model.state_dict(), on any ranks) waits here for
    # the stepped weights in flight to the other replicas (local: every rank started them after the step)
    sub.register_state_dict_pre_hook(lambda m, prefix, keep_vars: wait_replicas(m))
    session = PipelineSession(run, name, accumulation, lambda: module.training, lambda: _last_batch(module))
    module.__dict__[_ATTR] = session
    return session


def _last_batch(module: nn.Module) -> Optional[bool]:
    """Whether the Trainer's running evaluation loop is at its last batch (Lightning sets the flag
    before the step); None outside a Trainer's evaluation loop (Fabric, training)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    if trainer.predicting:
        loop = trainer.predict_loop
    elif trainer.testing:
        loop = trainer.test_loop
    elif trainer.validating or trainer.sanity_checking:
        loop = trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == "fit" else trainer.validate_loop
    else:
        return None
    return bool(loop.batch_progress.is_last_batch)


def predicting_loader(loader: Any, module: Optional[nn.Module]) -> Any:
    """``loader`` as the Trainer's prediction loop gets it: under pipeline parallelism with several
    data-parallel places, wrapped so that a place whose loader yields no batch at all (Lightning's
    prediction sampler gives a place none when the dataset has fewer samples than places) still
    meets the others' first check, which then refuses on every rank instead of leaving them waiting."""
    session = pipeline_of(module)
    trainer = getattr(module, "_trainer", None)
    if session is None or session.run.mesh.dp_size == 1 or trainer is None or not trainer.predicting:
        return loader
    return _PlacesLoader(loader, session)


class _PlacesLoader:
    """A prediction dataloader, passed through; its length at least 1, so that Lightning does not
    skip the loop of a place without a batch, which then joins the places' check once."""

    def __init__(self, loader: Any, session: PipelineSession) -> None:
        self.loader, self.session = loader, session

    def __iter__(self) -> Any:
        yielded = False
        for batch in self.loader:
            yielded = True
            yield batch
        if not yielded:
            check_places_agree(self.session.run, 0, NO_BATCH)

    def __len__(self) -> int:
        return max(1, len(self.loader))

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "session"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _inside(param: str, name: str) -> bool:
    return not name or param.startswith(name + ".")
