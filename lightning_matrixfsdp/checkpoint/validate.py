"""Checks of a checkpoint against the run: model keys, shapes and dtypes; optimizers; roles;
whether it holds the training state a resume needs.

Pure with respect to the model and the optimizers: nothing here writes into them.
Each check raises the documented error under strict loading (or always, where a
load would go silently wrong) and otherwise warns; the callers run them through
``agree`` so every rank reaches the same verdict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.agree import warn
from lightning_matrixfsdp.checkpoint.errors import CheckpointKeyError, CheckpointMismatchError, CheckpointNotResumableError
from lightning_matrixfsdp.checkpoint.formats import dtype_name, optimizer_class
from lightning_matrixfsdp.checkpoint.index import KeyIndex

__all__ = ["ModelMatch", "changed_roles", "check_optimizer", "check_resumable", "match_model", "rebase"]

# Group keys that do not tell optimizers apart: names, the scheduler's mark, and the flags
# torch's ``Optimizer.__setstate__`` fills in with defaults when a state is loaded.
_IGNORED_GROUP_KEYS = ("params", "param_names", "initial_lr", "differentiable", "foreach", "fused", "capturable",
                       "maximize")


def rebase(ck_keys: Sequence[str], module_keys: Iterable[str]) -> dict[str, str]:
    """ck key -> module key.  Identity, unless nothing matches and one prefix (added or stripped)
    maps every checkpoint key onto the module (a plain ``model.state_dict()`` of a submodule)."""
    module_keys = set(module_keys)
    ident = {k: k for k in ck_keys}
    if not ck_keys or any(k in module_keys for k in ck_keys):
        return ident
    prefixes = {k.rsplit(".", i)[0] for k in module_keys for i in range(1, k.count(".") + 1)}
    for p in sorted(prefixes, key=len):
        if all(f"{p}.{k}" in module_keys for k in ck_keys):
            return {k: f"{p}.{k}" for k in ck_keys}
    heads = {k.split(".", 1)[0] for k in ck_keys}
    if len(heads) == 1 and all("." in k for k in ck_keys):
        h = heads.pop()
        if all(k[len(h) + 1:] in module_keys for k in ck_keys):
            return {k: k[len(h) + 1:] for k in ck_keys}
    return ident


@dataclass
class ModelMatch:
    tensors: list[tuple[str, str]]     # (primary module key, ck key) to load
    objects: list[tuple[str, str]]     # extra state
    to_ck: dict[str, str]              # module key -> ck key, for every matched key
    from_ck: dict[str, str]            # ck key -> module key


def match_model(index: KeyIndex, specs: Mapping[str, tuple], strict: bool, what: str) -> ModelMatch:
    """Check keys, shapes and dtypes; raise the documented errors (identically on every rank)."""
    # pipeline parallelism: a stage loads its own keys (strictly); the other stages' are expected, not loaded here
    others = set(index.remote) | set(index.remote_extra)
    from_ck = rebase(list(specs), list(index.entries) + list(index.extra) + sorted(others))
    to_ck = {m: c for c, m in from_ck.items()}
    known = set(index.entries) | set(index.extra)
    overlap = [k for k in known if k in to_ck]
    if specs and not overlap:
        ex_c, ex_m = sorted(specs)[:3], list(index.entries)[:3]
        raise CheckpointMismatchError(
            f"{what} is a checkpoint of another model: none of its {len(specs)} keys match the module's "
            f"{len(known)} (checkpoint: {ex_c} ..., module: {ex_m} ...)")
    missing, shapes, dtypes, tensors, objects = [], [], [], [], []
    done: set[str] = set()
    for key, e in index.entries.items():
        if e.primary in done:
            continue
        ck = next((to_ck[a] for a in index.aliases(e.primary) if a in to_ck), None)
        if ck is None:
            missing.append(e.primary)
            continue
        done.add(e.primary)
        s = specs[ck]
        if s[0] != "t" or tuple(s[1]) != e.shape:
            shapes.append(f"{e.primary}: checkpoint {tuple(s[1]) if s[0] == 't' else 'non-tensor'} vs model {e.shape}")
            continue
        if s[2] != e.dtype:
            dtypes.append(f"{e.primary}: checkpoint {dtype_name(s[2])} vs model {dtype_name(e.dtype)}")
        tensors.append((e.primary, ck))
    for key in index.extra:
        if key in to_ck:
            objects.append((key, to_ck[key]))
        else:
            missing.append(key)
    unexpected = sorted(c for c, m in from_ck.items() if m not in known and m not in others)
    if shapes:
        raise CheckpointMismatchError(f"{what}: shape mismatch for {len(shapes)} tensor(s): " + "; ".join(shapes[:10]))
    if dtypes and strict:
        raise CheckpointMismatchError(
            f"{what}: dtype mismatch for {len(dtypes)} tensor(s): " + "; ".join(dtypes[:10])
            + " (set strict_loading=False to cast to the model's dtypes)")
    if dtypes:
        warn(f"{what}: casting {len(dtypes)} tensor(s) to the model's dtypes: " + "; ".join(dtypes[:5]))
    if missing and index.pp_size > 1 and strict:  # every stage judges its own keys: say which stage lacks them
        missing = [f"{k} (pipeline stage(s) {', '.join(str(r.stage) for r in index.roots)})" if i == 0 else k
                   for i, k in enumerate(missing)]
    if (missing or unexpected) and strict:
        raise CheckpointKeyError(
            f"{what} does not match the module (strict loading): missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}. Set the LightningModule's strict_loading=False to "
            "load the matching keys only")
    if missing or unexpected:
        warn(f"{what}: loading the matching keys only; missing keys {missing[:20]}, "
             f"unexpected keys {unexpected[:20]}")
    return ModelMatch(tensors, objects, to_ck, from_ck)


def check_optimizer(i: int, optimizer: torch.optim.Optimizer, current: Sequence[Sequence[str]],
                    saved_groups: Sequence[Mapping[str, Any]], saved_keys: Iterable[str], strict: bool,
                    saved_class: Optional[str], what: str) -> bool:
    """Whether optimizer ``i`` may take this state; raises under strict loading, else warns and skips."""
    problems = []
    if saved_class and saved_class != optimizer_class(optimizer):
        problems.append(f"it was saved from {saved_class}, the run uses {optimizer_class(optimizer)}")
    if len(saved_groups) != len(current):
        problems.append(f"it has {len(saved_groups)} param group(s), the current optimizer {len(current)}")
    else:
        # Only the optimizer's own hyper-parameters tell optimizers apart; keys others add to a
        # group (a scheduler's ``initial_lr``, SWALR's ``swa_lr``) are restored as torch does.
        own = set(getattr(optimizer, "defaults", None) or ()) or None
        for j, (sg, g) in enumerate(zip(saved_groups, optimizer.param_groups)):
            a = {k for k in sg if k not in _IGNORED_GROUP_KEYS and (own is None or k in own)}
            b = {k for k in g if k not in _IGNORED_GROUP_KEYS and (own is None or k in own)}
            if a != b:
                problems.append(f"param group {j} hyper-parameters differ (only in checkpoint: {sorted(a - b)}, "
                                f"only in the run: {sorted(b - a)})")
                break
    if problems:
        msg = f"{what}: optimizer {i} ({type(optimizer).__name__}) cannot take the saved state: " + "; ".join(problems)
        if strict:
            raise CheckpointMismatchError(msg)
        warn(msg + "; its state is left as it is (strict_loading=False)")
        return False
    key_problems = []
    for j, (sg, cur) in enumerate(zip(saved_groups, current)):
        if set(sg["params"]) != set(cur):
            key_problems.append(f"group {j}: only in checkpoint {sorted(set(sg['params']) - set(cur))[:10]}, "
                                f"only in the run {sorted(set(cur) - set(sg['params']))[:10]}")
    everything = {k for c in current for k in c}
    stray = sorted(k for k in saved_keys if k not in everything)
    if stray:
        key_problems.append(f"state for parameters the optimizer does not hold: {stray[:10]}")
    if key_problems:
        msg = f"{what}: optimizer {i} parameters differ: " + "; ".join(key_problems)
        if strict:
            raise CheckpointKeyError(msg + ". Set strict_loading=False to restore the matching entries")
        warn(msg + "; restoring the matching entries")
    return True


def changed_roles(index: KeyIndex, saved_roles: Mapping[str, str], keys_with_state: Iterable[str],
                  reset: bool, what: str) -> set[str]:
    """Parameters (module keys) whose optimizer role differs from the saved one and that have saved
    optimizer state. Raises unless ``reset``; with ``reset`` returns them (their state is dropped).

    A role change (a changed ``matrix_filter``) moves a parameter between the matrix optimizer
    and the AdamW tail: its saved state belongs to the other update rule and would sit unused."""
    changed = {}
    for key in keys_with_state:
        e = index.entries.get(key)
        saved = next((saved_roles[a] for a in index.aliases(e.primary) if a in saved_roles), None) if e else None
        if e is not None and e.role is not None and saved is not None and saved != e.role:
            changed[key] = f"{key}: {saved} -> {e.role}"
    if not changed:
        return set()
    listed = "; ".join(sorted(changed.values())[:20]) + (" ..." if len(changed) > 20 else "")
    if not reset:
        raise CheckpointMismatchError(
            f"{what}: the optimizer role of {len(changed)} parameter(s) changed since the save ({listed}), e.g. "
            "through another matrix_filter; their saved optimizer state belongs to the other update rule. Use the "
            "matrix_filter of the saved run, or pass reset_changed_roles=True (load_sharded, or "
            "MatrixFSDPStrategy(reset_changed_roles=True)) to restart their optimizer state")
    warn(f"{what}: restarting the optimizer state of {len(changed)} parameter(s) whose role changed: {listed}")
    return set(changed)


def check_resumable(what: str, holds_optimizers: bool, rest: Optional[Mapping[str, Any]]) -> None:
    """Refuse to resume training from a checkpoint without the training state, as Lightning does
    under DDP (``rest``: the checkpoint without its tensors; None for a plain ``state_dict``). A
    checkpoint holds it when it holds optimizer states, or the LR schedulers of a run that had no
    optimizer; a Fabric checkpoint (optimizer states, no loops) resumes with fresh counters."""
    if holds_optimizers or (rest is not None and "lr_schedulers" in rest):
        return
    kind = ("a plain state_dict (model weights only)" if rest is None else
            "only the model (saved with ModelCheckpoint(save_weights_only=True) or save_checkpoint(weights_only=True))")
    raise CheckpointNotResumableError(
        f"Trying to restore optimizer state but {what} holds {kind}: fit(ckpt_path=...) resumes training and needs "
        "the optimizer states and LR schedulers, as under DDP. To train from these weights, load them in the "
        "module (e.g. lightning_matrixfsdp.load_weights(self, path) in on_fit_start) and call fit without ckpt_path; "
        "validate/test/predict(ckpt_path=...) accept this checkpoint as it is")
