"""Lightning's features that read an optimizer's param groups, on routed optimizers as under DDP.

Routing leaves each rank only the parameters it owns in every param group
(``optim/routing.py``), so the groups differ between ranks. Two Lightning features read the
groups and act on the parameters they list, and must act on the same ones on every rank:

- ``LightningModule.toggle_optimizer`` freezes every parameter of the other optimizers'
  groups (manual optimization with several optimizers, e.g. a GAN). Over routed groups each
  rank froze only what it owns; the ranks then reduced different sets of gradients and gloo
  aborted (``Received data size doesn't match expected size``). :func:`install_toggles` gives
  the module versions with Lightning's semantics over the groups as the user gave them
  (:func:`full_param_groups`, the same on every rank).
- ``BaseFinetuning`` records each optimizer's groups by parameter name in its state and, on
  resume, puts them back in ``on_fit_start`` before the optimizer state is loaded: DDP restores
  a checkpoint before setup. This strategy restores after setup (the model must be sharded
  first), when ``on_fit_start`` has already run, so the optimizer had fewer groups than the
  checkpoint. :func:`full_finetuning_state` saves the recorded groups whole (they were the
  routed ones), and :func:`restore_finetuning_groups` runs the callbacks' own restore at the
  point where DDP's order would, just before the optimizer state is loaded.

Everything here takes the module, the trainer's callbacks and the optimizers, never the strategy.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Iterable, Mapping, Optional, Sequence

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BaseFinetuning
from torch.optim import Optimizer

from lightning_matrixfsdp.optim.routing import full_param_groups, route_optimizer
from lightning_matrixfsdp.runtime import follow_requires_grad

__all__ = ["full_finetuning_state", "install_toggles", "restore_finetuning_groups", "uninstall_toggles"]

_TOGGLES = ("toggle_optimizer", "untoggle_optimizer")


def toggle_optimizer(module: LightningModule, optimizer: Any) -> None:
    """``LightningModule.toggle_optimizer`` over every rank's full parameter lists: freeze the
    parameters of all optimizers, then give ``optimizer``'s back their own setting."""
    state: dict[Any, bool] = {}
    for opt in module.trainer.optimizers:
        for params in full_param_groups(opt):
            for p in params:
                if p not in state:
                    state[p] = p.requires_grad
                    p.requires_grad = False
    for params in full_param_groups(optimizer):
        for p in params:
            p.requires_grad = state[p]
    module._param_requires_grad_state = state
    follow_requires_grad(module)  # a unit materialized now (the root, in the training step) too


def untoggle_optimizer(module: LightningModule, optimizer: Any) -> None:
    """``LightningModule.untoggle_optimizer`` over the full lists: restore the other optimizers'
    parameters as they were before :func:`toggle_optimizer`."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the optimizer
    state = module._param_requires_grad_state
    for opt in module.trainer.optimizers:
        if opt is not inner and opt is not optimizer:
            for params in full_param_groups(opt):
                for p in params:
                    if p in state:
                        p.requires_grad = state[p]
    module._param_requires_grad_state = {}
    follow_requires_grad(module)


def install_toggles(module: LightningModule) -> None:
    """Give ``module`` the toggles above, unless its class defines its own (left as they are)."""
    for name, fn in zip(_TOGGLES, (toggle_optimizer, untoggle_optimizer)):
        if getattr(type(module), name) is getattr(LightningModule, name):
            # functools.partial rather than a bound method: the module still pickles
            object.__setattr__(module, name, functools.partial(fn, module))


def uninstall_toggles(module: Optional[LightningModule]) -> None:
    """Leave the module as it was before :func:`install_toggles` (at teardown)."""
    for name in _TOGGLES:
        if module is not None and isinstance(module.__dict__.get(name), functools.partial):
            del module.__dict__[name]


def _finetuning(callbacks: Iterable[Any]) -> list[BaseFinetuning]:
    return [cb for cb in callbacks if isinstance(cb, BaseFinetuning)]


def full_finetuning_state(checkpoint: dict[str, Any], callbacks: Iterable[Any], module: LightningModule,
                          optimizers: Sequence[Optimizer]) -> None:
    """In the checkpoint about to be saved: each ``BaseFinetuning`` state lists every group's
    parameters whole (by name), as under DDP, not the ones this rank owns. The callbacks' recorded
    groups line up with the optimizers' (it records all groups once, then appends the new ones)."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict):
        return
    names = {p: n for n, p in module.named_parameters()}
    for cb in _finetuning(callbacks):
        state = states.get(cb.state_key)
        recorded = state.get("internal_optimizer_metadata") if isinstance(state, Mapping) else None
        if not isinstance(recorded, Mapping):
            continue
        whole = {}
        for i, groups in recorded.items():
            full = full_param_groups(optimizers[i]) if isinstance(i, int) and i < len(optimizers) else []
            whole[i] = [{**g, "params": [names[p] for p in full[j]]} if j < len(full) else g
                        for j, g in enumerate(groups)]
        # a new dict: the callback's own state object is the live record
        states[cb.state_key] = {**state, "internal_optimizer_metadata": whole}


def restore_finetuning_groups(checkpoint: Optional[Mapping[str, Any]], trainer: Any, module: LightningModule,
                              optimizers: Sequence[Optimizer]) -> None:
    """Before the optimizer state is loaded: each ``BaseFinetuning`` callback with a state in
    ``checkpoint`` loads it and runs its ``on_fit_start``, which puts the recorded param groups
    back (DDP's order: callback state, then ``on_fit_start``, then the optimizer state); the new
    groups are then routed. Lightning loads the callback's state once more afterwards (the same)."""
    states = (checkpoint or {}).get("callbacks")
    if not isinstance(states, Mapping):
        return
    restored = False
    for cb in _finetuning(trainer.callbacks):
        state = states.get(cb.state_key)
        if state:
            cb.load_state_dict(copy.deepcopy(state))
            cb.on_fit_start(trainer, module)
            restored = True
    if restored:
        for opt in optimizers:
            route_optimizer(opt)
