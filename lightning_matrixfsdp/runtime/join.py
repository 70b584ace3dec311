"""Uneven inputs: ranks without a batch follow the others' evaluation steps.

Under owner sharding even an evaluation forward communicates: every unit is
materialized from its owners, so a rank that ran out of batches must still take
part in every materialization of the ranks that have one (as torch's ``Join``
keeps a finished DDP rank answering the all-reduces).

The protocol, per evaluation step, in ``EvalJoin``:

1. every rank says whether it has a batch (one small all-gather over the world);
   nobody has one: the evaluation is over on every rank;
2. if some rank has none, the step runs in *join mode*: a rank that is about to
   materialize a unit first announces it (an all-gather of ``(op, root, unit)``
   over its shard group); a rank without a batch, or one whose own step is done,
   answers with "idle"/"done" and materializes the announced unit with the others,
   releasing it at once; the step ends when nobody announces any more.

Under expert parallelism a rank's experts compute the tokens every rank of its
expert-parallel group routes to them, so an idle rank must also take part in each token
exchange: in join mode a rank about to run an experts module's exchange announces it
(``(exchange, module, hidden size, dtype)``), and a rank without a batch answers by running
that module's exchange with no token of its own (``expert_seams.exchange_without_tokens``):
its experts compute what the others send and send the results back. The announcements then
go over the whole world, not the shard group: under HSDP an expert-parallel group need not
lie inside one shard group, and every rank of it must hear of the exchange.

Why announcements rather than replaying a recorded forward or a rank's last batch:
a replay is exact only if every forward runs the same units in the same order
(``predict_step`` loops, data-dependent branches, a rank with no batch at all to
replay); following the ranks that compute is exact whatever they run, and costs
one tiny all-gather per materialization only in the steps where some rank is idle.
Steps where every rank has a batch cost the one flag all-gather.

Pipeline stages (the roots under pipeline parallelism) cannot be followed this way either: a
rank without a batch would have to run its stage's part of the other ranks' schedules. There the
flag all-gather of step 1 makes every rank raise :class:`UnevenInputsError` at the first step
where some rank has no batch, instead of hanging in the schedule.

Training cannot be joined this way (the idle rank has no gradients to contribute,
and DDP hangs too): :meth:`EvalJoin.check_training_step` makes every rank raise
:class:`UnevenInputsError` at the first step where the ranks' batch counts differ.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Sequence

import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.errors import RankDivergenceError, UnevenInputsError
from lightning_matrixfsdp.runtime.experts.dispatch import dtype_code, dtype_of_code
from lightning_matrixfsdp.runtime.experts.seams import exchange_without_tokens, joinable_seams, set_exchange_announce
from lightning_matrixfsdp.runtime.comm.small import gather_ints
from lightning_matrixfsdp.runtime.state import MatrixFSDPState
from lightning_matrixfsdp.runtime.tags import is_stage, state_of

#: an announcement row is (op, a, b, c): (MATERIALIZE, root, unit, 0), (EXCHANGE, experts module,
#: hidden size, dtype code), or (IDLE/DONE, -1, -1, -1) from a rank with nothing to announce
IDLE, DONE, MATERIALIZE, EXCHANGE = range(4)
_NOTHING = (-1, -1, -1)


class EvalJoin:
    """Keeps the ranks of sharded models in step through evaluation loops of unequal length."""

    def __init__(self, roots: Sequence[nn.Module]) -> None:
        """``roots``: the sharded models (``sharded_roots``) whose steps the ranks keep in step."""
        self.states: list[MatrixFSDPState] = [state_of(r) for r in roots]
        #: the experts modules whose token exchanges the ranks keep in step (expert parallelism), and their names
        self.seams: list[nn.Module] = []
        self.seam_names: list[str] = []
        for root in roots:
            names = {id(m): n for n, m in root.named_modules()}
            for m in joinable_seams(root):
                if all(m is not s for s in self.seams):
                    self.seams.append(m)
                    self.seam_names.append(names.get(id(m)) or "<root>")
        # every root of one strategy shards over the same ranks: the first one's group carries
        # announcements; the world's under expert parallelism (an expert-parallel group may span shard groups)
        self.group = self.states[0].sg.group if not self.seams else None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.steps = 0  # evaluation steps this rank ran since the last drain
        self.joining = False
        #: pipeline stages: uneven evaluation is refused, not joined (module docstring)
        self.pipelined = any(is_stage(r) for r in roots)

    def serves(self, roots: Sequence[nn.Module]) -> bool:
        """Whether this join keeps exactly the sharded models ``roots`` in step (their runtimes now)."""
        return [state_of(r) for r in roots] == self.states

    # ------------------------------------------------------------------ evaluation steps
    def begin_step(self) -> None:
        """Before this rank's evaluation step: agree on who has a batch; join mode if not everyone."""
        self.steps += 1
        have = self._count_batches(True)
        if self.pipelined and have < self.world:
            self._refuse_pipelined(have)
        self.joining = have < self.world
        if self.joining:
            for i, state in enumerate(self.states):
                state.schedule.announce = (lambda unit, root=i: self._announce(root, unit))
            for i, seam in enumerate(self.seams):
                set_exchange_announce(seam, lambda hidden, seam=i: self._announce_exchange(seam, hidden))

    def end_step(self, is_last: bool) -> None:
        """After this rank's evaluation step; ``is_last``: it had no further batch, so it
        follows the others' steps until every rank is done."""
        if self.joining:
            for state in self.states:
                state.schedule.announce = None
            for seam in self.seams:
                set_exchange_announce(seam, None)
            self._serve(DONE)
            self.joining = False
        if is_last:
            self.drain()

    def drain(self) -> None:
        """Out of batches: follow the other ranks' steps until no rank has a batch."""
        while (have := self._count_batches(False)):
            if self.pipelined:
                self._refuse_pipelined(have)
            self._serve(IDLE)
        for state in self.states:
            state.release_all()
        self.steps = 0

    def wrap(self, iterable: Iterable[Any], training: bool = False) -> "JoinedLoader":
        """A dataloader whose rank, if it yields no batch at all, still follows the others'
        evaluation steps, or (``training``) takes part in the uneven-inputs check."""
        return JoinedLoader(iterable, self, training)

    def _refuse_pipelined(self, have: int) -> None:
        """Every rank raises alike (they all counted the same gathered flags)."""
        self.steps = 0
        raise UnevenInputsError(
            f"MatrixFSDP: {have} of {self.world} ranks have an evaluation or prediction batch in this step, under pipeline "
            "parallelism, where a rank without a batch cannot run its stage's part of the others' schedules. "
            "Give every rank the same number of batches: keep use_distributed_sampler=True "
            "(Lightning's DistributedSampler pads to equal lengths), or set limit_val_batches / "
            "limit_test_batches / limit_predict_batches to at most the smallest count.")

    # ------------------------------------------------------------------ training
    def check_training_step(self, has_batch: bool, is_last: bool) -> None:
        """Raise :class:`UnevenInputsError` on every rank where ranks disagree on whether this
        training batch is their last (their batch counts differ)."""
        rows = gather_ints([int(has_batch), int(is_last)], None, "the uneven-inputs check of a training step")
        if all(r == rows[0] for r in rows):
            return
        state = "; ".join(f"rank {r}: " + ("no batch" if not h else "its last batch" if last else "more batches")
                          for r, (h, last) in enumerate(rows))
        raise UnevenInputsError(
            f"MatrixFSDP: the ranks have different numbers of training batches ({state}). Every rank "
            "must run the same number of training steps (as under DDP): keep use_distributed_sampler=True "
            "(Lightning's DistributedSampler pads to equal lengths), give every rank the same number of "
            "batches, or set max_steps/limit_train_batches to at most the smallest count.")

    # ------------------------------------------------------------------ protocol
    def _count_batches(self, have: bool) -> int:
        rows = gather_ints([int(have)], None, "the evaluation join's has-a-batch agreement")
        return sum(r[0] for r in rows)

    def _announce(self, root: int, unit: int) -> None:
        rows = gather_ints([MATERIALIZE, root, unit, 0], self.group, "the evaluation join's announcement")
        self._wanted(rows)

    def _announce_exchange(self, seam: int, hidden: Any) -> None:
        """Before this rank's token exchange in experts module ``seam`` (``hidden``: its tokens)."""
        size = int(hidden.shape[-1]) if hidden.dim() else 0
        rows = gather_ints([EXCHANGE, seam, size, dtype_code(hidden.dtype)], self.group,
                           "the evaluation join's announcement")
        self._wanted(rows)

    def _serve(self, status: int) -> None:
        """Answer announcements with ``status`` and run what they name, until none comes."""
        while True:
            rows = gather_ints([status, *_NOTHING], self.group, "the evaluation join's announcement")
            wanted = self._wanted(rows)
            if wanted is None:
                return
            op, a, b, c = wanted
            if op == MATERIALIZE:
                self.states[a].materialize_for_peers(b)
            else:
                exchange_without_tokens(self.seams[a], b, dtype_of_code(c))  # type: ignore[arg-type]

    def _wanted(self, rows: list[list[int]]) -> Optional[tuple[int, int, int, int]]:
        """The one operation the ranks with a step announced (None: nobody announced); every rank
        raises where they announced different ones, or an exchange this join cannot follow."""
        want = {tuple(row) for row in rows if row[0] in (MATERIALIZE, EXCHANGE)}
        if len(want) > 1:  # every rank holds the same rows: every rank raises
            doing = "; ".join(f"rank {i} {self._describe(row)}" for i, row in enumerate(rows)
                              if row[0] in (MATERIALIZE, EXCHANGE))
            raise RankDivergenceError(
                f"MatrixFSDP ranks diverged in an evaluation step: {doing}. Every rank with a batch must run "
                "the same units and experts modules in the same order.")
        wanted = next(iter(want), None)
        if wanted is not None and wanted[0] == EXCHANGE and dtype_of_code(wanted[3]) is None:
            raise UnevenInputsError(
                f"MatrixFSDP: the ranks with a batch {self._describe(list(wanted))}, but the ranks without one "
                "can only follow an expert-parallel exchange of float32, float64, bfloat16 or float16 hidden "
                "states; give every rank the same number of evaluation batches, or use one of those dtypes.")
        return wanted  # type: ignore[return-value]

    def _describe(self, row: list[int]) -> str:
        op, a, b, c = row
        if op == MATERIALIZE:
            return f"materializes unit {self._name(a, b)}"
        name = repr(self.seam_names[a]) if 0 <= a < len(self.seam_names) else f"#{a}"
        dtype = dtype_of_code(c)
        return (f"runs the token exchange of experts module {name} (hidden size {b}, "
                f"{dtype if dtype is not None else 'an unsupported dtype'})")

    def _name(self, root: int, unit: int) -> str:
        try:
            return repr(self.states[root].units[unit].fqn or "<root>")
        except IndexError:
            return f"#{unit}"


class JoinedLoader:
    """An evaluation dataloader, passed through; a rank whose iterator yields nothing follows
    the other ranks' steps right away (no step of its own would ever end with :meth:`EvalJoin.end_step`)."""

    def __init__(self, loader: Iterable[Any], join: EvalJoin, training: bool = False) -> None:
        self.loader = loader
        self.join = join
        self.training = training

    def __iter__(self) -> Iterator[Any]:
        yielded = False
        for batch in self.loader:
            yielded = True
            yield batch
        if yielded:
            return
        if self.training:
            self.join.check_training_step(False, True)
        elif self.join.steps == 0:
            self.join.drain()

    def __len__(self) -> int:
        # at least 1: Lightning skips an evaluation loop of length 0, and a skipped rank could not follow
        return max(1, len(self.loader))  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "join", "training"):
            raise AttributeError(name)
        return getattr(self.loader, name)
