"""Runtime objects refuse to be pickled, with a message that says what to do instead.

A sharded model reaches its runtime through the hooks on its modules and the state on its
root.  Pickling it (``torch.save(model)``, ``trainer.model``) would otherwise fail deep
inside with ``cannot pickle 'ProcessGroup' object``; and it could not work: one process
holds only the weights it owns (empty placeholders for the rest) and handles to process
groups, so no single process can write the whole model, and no collective can run inside
``pickle``.  :class:`RefusePickle` says so and names the ways that do work.

``copy.deepcopy`` is not pickling: it copies these objects exactly as it copies any plain
object (``__deepcopy__`` below does what ``copy`` does by default), so whatever deep copies
do with a sharded model is unchanged by the refusal.
"""

from __future__ import annotations

import copy
from typing import Any

WHAT_TO_DO = (
    "Save a checkpoint instead: trainer.save_checkpoint(path) (a directory of per-rank files; "
    "MatrixFSDPStrategy(save_distributed_checkpoint=False) writes one consolidated file, and "
    "`python -m lightning_matrixfsdp.consolidate` converts a directory into one), or enter "
    "`with lightning_matrixfsdp.full_model(model, rank=0):` on every rank and call torch.save(model) "
    "(or model.state_dict()) on rank 0 inside it, where the model is a plain module with all its weights")


class RefusePickle:
    """Mixin: ``pickle`` raises ``TypeError`` naming the object and the alternatives."""

    def _pickle_name(self) -> str:
        return type(self).__name__

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"cannot pickle a model sharded by lightning_matrixfsdp (it reached {self._pickle_name()}): each rank "
            "holds only the weights it owns, empty placeholders for the others, and its process groups, so one "
            f"process cannot write the whole model and a pickle would silently lose weights. {WHAT_TO_DO}.")

    def __deepcopy__(self, memo: dict) -> Any:
        # What copy.deepcopy does for a plain object (it would otherwise call __reduce_ex__).
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __copy__(self) -> Any:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new
