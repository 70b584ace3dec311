"""The ranks of a shard group agree before they communicate differently.

Two checks, both "agree first, then raise on every rank": :func:`validate_schedule`
compares plan and options once, when ``matrix_shard`` runs; :class:`SequenceCheck`
compares, before every unit operation, which operation each rank is about to start,
so that a unit skipped or run on some ranks only, or gradients given to different
parameters, raise :class:`RankDivergenceError` naming the units and ranks instead of
hanging or aborting inside a mismatched collective.

A third, :class:`PeerCheck`, is for forwards that no training loop schedules on every
rank (under the Trainer: outside its steps, e.g. sampling in a hook under
``trainer.is_global_zero``): the ranks meet at a monitored barrier that gives up after
seconds, and a rank that waited in vain raises :class:`LoneForwardError` instead of
hanging in the materialization until the process-group timeout.

The sequence check costs one small all-gather per unit operation on a CPU (gloo)
group, on the host.  It is on where the shard group itself runs on gloo, and off on
NCCL unless ``MATRIX_FSDP_CHECK_SEQUENCE=1`` (then a gloo group beside the shard group
carries it); ``MATRIX_FSDP_CHECK_SEQUENCE=0`` turns it off everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import ShardGroup
from lightning_matrixfsdp.runtime.errors import LoneForwardError, RankDivergenceError
from lightning_matrixfsdp.runtime.placement import Plan, first_difference
from lightning_matrixfsdp.runtime.comm.small import gather_ints, gather_objects, gloo_subgroups, monitored_barrier

#: ``1``: check the sequence on every backend; ``0``: nowhere; unset: where the shard group is gloo.
CHECK_ENV = "MATRIX_FSDP_CHECK_SEQUENCE"
#: What a rank is about to do to a unit, by operation code (:data:`MATERIALIZE` ...).
OPS = ("materialize", "reduce the gradients of", "agree on the used gradients of",
       "broadcast rank 0's buffers before the forward of")
MATERIALIZE, REDUCE, AGREE_USED, SYNC_BUFFERS = range(len(OPS))
#: Seconds every rank has to join a forward outside the Trainer's steps; ``0`` turns the check off.
LONE_FORWARD_ENV = "MATRIX_FSDP_LONE_FORWARD_TIMEOUT"
LONE_FORWARD_TIMEOUT_S = 30.0


def validate_schedule(plan: Plan, schedule: dict, sg: ShardGroup, group_name: str = "shard-group") -> None:
    """Compare plan and schedule across the shard group (or the group ``group_name`` names, e.g.
    the tensor-parallel group) before any data moves.

    Every rank receives every digest, so on a mismatch every rank raises the same
    error instead of some of them waiting in a collective that never matches.
    """
    if sg.size == 1:
        return
    mine = hashlib.sha256((plan.digest() + json.dumps(schedule, sort_keys=True)).encode()).hexdigest()
    digests = gather_objects(mine, sg.group)
    if all(d == digests[0] for d in digests):
        return
    payload = {"plan": plan.to_dict(), "schedule": schedule}
    everyone = gather_objects(payload, sg.group)
    ref = everyone[0]
    for r in range(1, sg.size):
        if digests[r] == digests[0]:
            continue
        other = everyone[r]
        if other["schedule"] != ref["schedule"]:
            keys = [k for k in ref["schedule"] if ref["schedule"].get(k) != other["schedule"].get(k)]
            where = "schedule option(s) " + ", ".join(
                _nested_difference(k, ref["schedule"].get(k), other["schedule"].get(k)) for k in keys)
        else:
            where = first_difference(ref["plan"], other["plan"])
        fix = ("Every rank must build the same model and call matrix_shard with the same options." if
               group_name == "shard-group" else "Every rank of a tensor-parallel group must build the same model, "
               "apply the same parallelize plan and call matrix_shard with the same options.")
        raise RuntimeError(
            f"MatrixFSDP plan mismatch between {group_name} rank 0 and rank {r} (global ranks {sg.g(0)} and "
            f"{sg.g(r)}): {where}. {fix}"
        )


def _nested_difference(path: str, a: Any, b: Any) -> str:
    """``path: a vs b`` at the first key where two nested dicts differ (the TP layouts of one
    parameter, not the whole tensor_parallel entry)."""
    while isinstance(a, dict) and isinstance(b, dict):
        key = next((k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)), None)
        if key is None:
            break
        path, a, b = f"{path}[{key!r}]", a.get(key), b.get(key)
    return f"{path}: {a!r} vs {b!r}"


def sequence_check_wanted(sg: ShardGroup) -> bool:
    """Whether this shard group runs the sequence check (see the module docstring)."""
    setting = os.environ.get(CHECK_ENV, "").strip()
    if sg.size == 1 or setting == "0":
        return False
    return setting == "1" or sg.blocks_host


class SequenceCheck:
    """Before each unit operation every rank says which one it is about to start; all must agree."""

    def __init__(self, group: Optional[dist.ProcessGroup], unit_names: list[str]) -> None:
        self.group = group  # a gloo group over the shard group's ranks
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.names = unit_names
        self.count = 0
        #: what each rank reports on a divergence (the root sets it: units waiting for gradients)
        self.describe: Callable[[], str] = lambda: ""

    def __call__(self, op: int, unit: int) -> None:
        """``op``: :data:`MATERIALIZE`, :data:`REDUCE`, :data:`AGREE_USED` or :data:`SYNC_BUFFERS`;
        ``unit``: its index in the plan."""
        seen = gather_ints([self.count, op, unit], self.group,
                           f"the sequence check before it would {self._what(op, unit)}")
        self.count += 1
        if any(s != seen[0] for s in seen):
            raise self._diverged(seen)

    def _what(self, op: int, unit: int) -> str:
        name = self.names[unit] if 0 <= unit < len(self.names) else f"#{unit}"
        return f"{OPS[op] if 0 <= op < len(OPS) else f'op {op}'} unit {name or '<root>'!r}"

    def _diverged(self, seen: list[list[int]]) -> RankDivergenceError:
        # Every rank holds the same rows, so every rank gets here: one more collective is safe.
        notes = gather_objects(self.describe(), self.group)
        counts = {n for n, _, _ in seen}
        doing = "; ".join(f"rank {r} is about to {self._what(op, unit)}"
                          + (f" (its operation #{n} on this model)" if len(counts) > 1 else "")
                          for r, (n, op, unit) in enumerate(seen))
        waiting = "; ".join(f"on rank {r}, {note}" for r, note in enumerate(notes) if note)
        return RankDivergenceError(
            f"MatrixFSDP ranks diverged: {doing}. Every rank must run the same units in the same order "
            "(no unit skipped or called on some ranks only, no submodule of a unit called on its own) and, "
            "unless zero_missing_grads=True, give gradients to the same parameters (a branch or expert used "
            "on some ranks only needs zero_missing_grads=True)."
            + (f" Gradients missing: {waiting}." if waiting else ""))


def host_group(sg: ShardGroup) -> Optional[dist.ProcessGroup]:
    """A gloo group over the shard group's ranks: the shard group itself on gloo; else one
    created beside every shard group (collective over the whole world)."""
    if sg.blocks_host:
        return sg.group
    spans = gather_objects(sg.global_ranks)
    return gloo_subgroups([list(s) for s in dict.fromkeys(tuple(s) for s in spans)])


def make_sequence_check(sg: ShardGroup, unit_names: list[str]) -> SequenceCheck:
    """The sequence check of this shard group (where :func:`sequence_check_wanted`).
    Collective over the whole world when the shard group is not gloo (:func:`host_group`)."""
    return SequenceCheck(host_group(sg), unit_names)


def lone_forward_timeout() -> float:
    """Seconds a :class:`PeerCheck` waits (``MATRIX_FSDP_LONE_FORWARD_TIMEOUT``; ``0``: no check)."""
    setting = os.environ.get(LONE_FORWARD_ENV, "").strip()
    try:
        return float(setting) if setting else LONE_FORWARD_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{LONE_FORWARD_ENV}={setting!r} is not a number of seconds") from None


def world_host_group() -> Optional[dist.ProcessGroup]:
    """A gloo group of its own over the whole world (collective over the world): the lone-forward
    check of a pipelined model, whose every forward involves every rank. Its own group, so a check
    that gave up leaves the world group's collectives in step."""
    return gloo_subgroups([list(range(dist.get_world_size()))])


class PeerCheck:
    """Before a forward that no training loop scheduled on every rank, the ranks of the shard
    group meet within :func:`lone_forward_timeout` seconds (a gloo monitored barrier, which
    gives up on its own instead of waiting for the process-group timeout). ``pipelined``: the
    check of a pipelined model's stages, over the whole world (its schedule runs on every rank)."""

    def __init__(self, group: Optional[dist.ProcessGroup], global_ranks: list[int], pipelined: bool = False) -> None:
        self.group = group  # gloo, over the shard group's ranks (:func:`host_group`), or the world's
        self.global_ranks = global_ranks
        self.pipelined = pipelined

    def __call__(self) -> None:
        timeout = lone_forward_timeout()
        if timeout <= 0 or len(self.global_ranks) == 1:
            return
        try:
            monitored_barrier(self.group, timeout)
        except RuntimeError as e:
            me = dist.get_rank()
            others = [r for r in self.global_ranks if r != me]
            raise LoneForwardError((_lone_pipelined if self.pipelined else _lone)(me, others, timeout, e)) from e


def _lone(me: int, others: list[int], timeout: float, e: Exception) -> str:
    return (f"MatrixFSDP: rank {me} started a forward of the sharded model outside the Trainer's steps "
            f"(in a hook such as on_validation_epoch_end, or after fit), and the other rank(s) {others} of "
            f"its shard group did not join it within {timeout:g} s ({e}). Every forward of a sharded model "
            "is collective: each unit's weights come from their owner ranks, so a forward on some ranks only "
            "(under `if trainer.is_global_zero:` or another rank-dependent branch) cannot run and would hang "
            "until the process-group timeout. Run the forward on every rank, or, to use the whole model on "
            "one rank (sampling, export), enter `with lightning_matrixfsdp.full_model(module, rank=0):` on "
            "every rank and run it on rank 0 inside (docs/user-guide.md, 'The whole model on one rank'). "
            f"{LONE_FORWARD_ENV} sets this wait in seconds (0 turns the check off)")


def _lone_pipelined(me: int, others: list[int], timeout: float, e: Exception) -> str:
    return (f"MatrixFSDP: rank {me} started a forward of the pipelined model (forward_outputs or forward_loss) "
            "outside the Trainer's steps (in a hook such as on_validation_epoch_end, or after fit), and the other "
            f"rank(s) {others} did not join it within {timeout:g} s ({e}). Under pipeline parallelism every "
            "forward runs through the pipeline schedule, in which each rank runs its own stages, so a forward on "
            "some ranks only (under `if trainer.is_global_zero:` or another rank-dependent branch) cannot run "
            "and would hang until the process-group timeout; full_model cannot gather a pipelined model either. "
            "Call `lightning_matrixfsdp.forward_outputs(self, inputs)` on every rank (the ranks of one pipeline "
            "group with the same inputs): every rank gets the outputs, and rank 0 may use them alone; to sample "
            "or export on one rank, save a checkpoint and load it into the unsplit model "
            "(pipeline_parallel_size=1; docs/pipeline-parallel.md). "
            f"{LONE_FORWARD_ENV} sets this wait in seconds (0 turns the check off)")
