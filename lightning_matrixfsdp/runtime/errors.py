"""The runtime's error classes, so that users can catch them by class.

``MatrixShardError``: a model or option that ``matrix_shard`` or a strategy cannot take,
raised when the option or model is given. The others: what goes wrong while training.

This module imports nothing, of the package or beyond: raising an error must not pull in
the planner or the option checks (``tests/test_structure.py`` guards it).
"""

from __future__ import annotations


class MatrixShardError(ValueError):
    """A model or option that matrix_shard (or the strategy) cannot handle."""


class RankDivergenceError(RuntimeError):
    """The ranks of a shard group are about to communicate differently: a unit skipped or
    run on some ranks only, or parameters given gradients on some ranks only.  Every rank
    raises it, with the same message, before any data of the mismatched step moves."""


class CollectiveInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while this rank waited in a MatrixFSDP collective that did
    not finish (a peer is stuck or gone).  A ``KeyboardInterrupt``, so Lightning shuts down
    as after Ctrl-C; the process then leaves without waiting for the collective."""


class UnevenInputsError(RuntimeError):
    """Ranks have different numbers of training batches (evaluation handles uneven inputs;
    training, as under DDP, cannot).  Every rank raises it at the first step where the
    counts differ."""


class LoneForwardError(RuntimeError):
    """A forward of a sharded model outside the Trainer's steps (a hook, or after ``fit``)
    was not joined by every rank of its shard group within seconds: every forward is
    collective, so one run under ``if trainer.is_global_zero:`` cannot proceed.  Raised on
    the rank(s) that started it; ``full_model`` is the way to use the whole model on one rank."""
