"""Checkpoint IO for owner-sharded models: DCP with a layout sidecar, resharding load, consolidated export.

Why a package of its own: under owner placement a rank holds a parameter either
whole or as an empty placeholder, and its optimizer holds state only for what it
owns.  Lightning's inherited paths would save the placeholders (data loss) or
collide inside DCP (same key, different sizes).  Here every tensor is written
once, whole, by its owner, keyed by its fully qualified name (fqn), so a
checkpoint does not depend on the world size or the plan that wrote it.

Formats (see ``docs/checkpointing.md``):

* *distributed* (a directory): ``torch.distributed.checkpoint`` of
  ``{"state_dict": {fqn: tensor}, "optimizer_<i>": {"state": {fqn: {name: value}},
  "param_groups": [{..., "params": [fqn, ...]}]}}``, the layout Lightning's
  ``ModelParallelStrategy`` writes, plus ``meta.pt`` (loops, schedulers,
  callbacks) and the JSON layout sidecar ``matrix_fsdp_layout.json``.
* *consolidated* (one file): an ordinary Lightning checkpoint with full tensors;
  optimizer states in torch's native format (integer ids) with ``param_names``.

Files, one concern each, dependencies one way (top to bottom)::

    errors       the error classes
    agree        agreement across ranks (every rank raises alike), object collectives
    index        the key index of a module (owners, shapes, roles, local data), built once
    formats      pure conversions: native optimizer state, DCP keys
    sidecar      the layout sidecar: build, read, check
    integrity    file sizes and CRC-32 checksums: record and verify
    state_dict   sharded and full model/optimizer state dicts
    views        sharded tensors anywhere in a checkpoint (the model's view, averaged copies)
    validate     checks of a checkpoint against the run (keys, shapes, optimizers, roles)
    optimizer_state  fragment or whole optimizer state at any mesh; what a rank restores of it
    save         write and publish atomically; stale partials
    load         validate and read everything, then write in place
    pretrained   Hugging Face safetensors (or a checkpoint) read by the owners into a meta-built model
    consolidate  directory <-> file conversion (``python -m lightning_matrixfsdp.consolidate``)

Callers hand in modules, optimizers, paths and flags; nothing here sees the strategy.
The runtime is read only through its frozen view of a sharded model
(``views/checkpoint``: owner, shape, role, local data, tied names, stepping
replica) and used only through its communication modules.
"""
from lightning_matrixfsdp.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotResumableError,
)
from lightning_matrixfsdp.checkpoint.formats import from_native, optimizer_class, to_native
from lightning_matrixfsdp.checkpoint.index import KeyIndex, build_index
from lightning_matrixfsdp.checkpoint.load import load_sharded, load_weights
from lightning_matrixfsdp.checkpoint.pretrained import PretrainedLoad, load_pretrained, meta_init
from lightning_matrixfsdp.checkpoint.save import PARTIAL_PREFIX, save_sharded, write_checkpoint
from lightning_matrixfsdp.checkpoint.sidecar import META_NAME, SIDECAR_NAME, layout_dict, read_sidecar
from lightning_matrixfsdp.checkpoint.state_dict import sharded_model_state_dict, sharded_optimizer_state_dict
from lightning_matrixfsdp.checkpoint.views import model_view

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointKeyError", "CheckpointMismatchError",
    "CheckpointNotResumableError", "KeyIndex",
    "META_NAME", "PARTIAL_PREFIX", "SIDECAR_NAME", "build_index", "from_native", "layout_dict", "load_sharded",
    "load_pretrained", "load_weights", "meta_init", "model_view", "PretrainedLoad", "optimizer_class", "read_sidecar", "save_sharded", "sharded_model_state_dict",
    "sharded_optimizer_state_dict", "to_native", "write_checkpoint",
]
