"""The Trainer's ``optimizer=`` replacement: the new optimizer, and the module's LR schedulers on it.

``MatrixFSDPStrategy(optimizer=...)`` trains an unmodified module with another optimizer
(the fine-tuning route): the one optimizer of ``configure_optimizers`` is replaced, and
its LR schedulers are carried over to the replacement. The replacement keeps its own
learning rates; each scheduler goes on applying to them the factors it would have
applied to the module's optimizer under DDP (same interval, frequency and monitor:
Lightning's scheduler configs are kept, only their scheduler is re-pointed).

How a scheduler follows: it is re-pointed to the new optimizer, and every value of it
that is a learning rate (``base_lrs``, ``eta_min``, ``min_lrs``, ``max_lrs``, ...), and
the learning-rate entries that schedulers keep in the param groups (``lr``,
``initial_lr``, OneCycleLR's ``max_lr``/``min_lr``), is rescaled by
``new_lr / module_lr`` per param group, through the scheduler's own ``state_dict`` /
``load_state_dict``. From then on the scheduler itself computes every step on the new
optimizer, so a schedule with no absolute learning rate in it (LambdaLR, StepLR,
LinearLR, ...) gives exactly what it gives when built on the replacement. Composite
schedulers (``SequentialLR``, ``ChainedScheduler``) carry their children along. The
reference ``module_lr`` is the group's ``initial_lr`` (its learning rate when the first
scheduler was built), except for OneCycleLR and CyclicLR, whose ``max_lr`` replaces the
optimizer's learning rate: there the replacement's learning rate becomes the peak.
Momentum cycling (``cycle_momentum``) is absolute, as on any optimizer, and moves as it is.

A scheduler that cannot follow is dropped with a warning that says why.

Everything here takes optimizers, parameters and Lightning's scheduler configs, never
the strategy.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim import lr_scheduler as S

from lightning_matrixfsdp.adapters.shared import build_replacement, replacement_note

__all__ = ["follow_schedulers", "replace_optimizer"]

#: Learning-rate entries schedulers keep in the optimizer's param groups.
GROUP_LRS = ("lr", "initial_lr", "max_lr", "min_lr")
#: Momentum entries OneCycleLR / CyclicLR keep there (absolute values).
GROUP_MOMENTA = ("max_momentum", "base_momentum")
#: Per param group learning-rate lists in a scheduler's state, by class (``LRScheduler``: all).
STATE_LR_LISTS: dict[type, tuple[str, ...]] = {
    S.LRScheduler: ("base_lrs", "_last_lr"),
    S.CyclicLR: ("max_lrs",),
    S.ReduceLROnPlateau: ("min_lrs",),
}
#: One learning rate shared by every param group (needs one ratio for all groups), by class.
STATE_LR_SCALARS: dict[type, tuple[str, ...]] = {
    S.CosineAnnealingLR: ("eta_min",),
    S.CosineAnnealingWarmRestarts: ("eta_min",),
    S.ReduceLROnPlateau: ("eps", "default_min_lr"),
}


def replace_optimizer(factory: Callable[[Iterable[nn.Parameter]], Optimizer], params: Sequence[nn.Parameter],
                      optimizers: Sequence[Optimizer], configs: Sequence[Any],
                      who: str = "MatrixFSDPStrategy") -> tuple[Optimizer, list[Any]]:
    """(the optimizer ``factory`` builds over ``params`` in place of the one in ``optimizers``,
    the scheduler ``configs`` that now drive it)."""
    if len(optimizers) > 1:
        raise MisconfigurationException(
            f"{who}(optimizer=...) replaces one optimizer, but configure_optimizers returned "
            f"{len(optimizers)}; drop the strategy's optimizer option or return a single optimizer"
        )
    old = optimizers[0] if optimizers else None
    try:
        new = build_replacement(factory, params, 1, who)
    except TypeError as e:
        raise MisconfigurationException(str(e)) from None
    kept = follow_schedulers(old, new, configs, who) if old is not None else []
    rank_zero_info(f"{who}: {replacement_note(new, old)}")
    return new, kept


def follow_schedulers(old: Optimizer, new: Optimizer, configs: Sequence[Any], who: str) -> list[Any]:
    """Re-point the schedulers of ``configs`` (Lightning's ``LRSchedulerConfig``) from ``old`` to
    ``new`` (in place); returns the configs kept. Each one dropped is warned about, with why."""
    reasons = {id(c): _why_not(c.scheduler, old, new) for c in configs}
    for c in configs:
        if reasons[id(c)] is not None:
            rank_zero_warn(f"{who}(optimizer=...): dropping LR scheduler {type(c.scheduler).__name__}: "
                           f"{reasons[id(c)]}")
    kept = [c for c in configs if reasons[id(c)] is None]
    if not kept:
        return []
    scale = _Scale(_reference_lrs(old, [c.scheduler for c in kept]), [g["lr"] for g in new.param_groups])
    # Schedulers wrap their optimizer's step() when built, to check the call order; one moved to
    # ``new`` would warn that step() "has been overridden". Building one on ``new`` installs it
    # (it only sets each group's ``initial_lr`` and multiplies its LR by 1; both are set below).
    S.LambdaLR(new, lambda _: 1.0)
    cycles = any(getattr(s, "cycle_momentum", False) for c in kept for s in _tree(c.scheduler))
    for g, (go, gn) in enumerate(zip(old.param_groups, new.param_groups)):
        for key in GROUP_LRS:
            if key in go:
                _set(gn, key, scale(g, go[key]))
        if cycles:
            _copy_momentum(go, gn, old, new)
    for c in kept:
        _retarget(c.scheduler, new, scale)
        rank_zero_info(f"{who}(optimizer=...): LR scheduler {type(c.scheduler).__name__} now drives "
                       f"{type(new).__name__}, rescaled to its learning rates")
    return kept


class _Scale:
    """``x -> new_ref * (x / old_ref)`` per param group; a reference maps exactly to its counterpart."""

    def __init__(self, old_refs: Sequence[Any], new_refs: Sequence[Any]) -> None:
        self.old, self.new = [float(r) for r in old_refs], [float(r) for r in new_refs]

    def __call__(self, g: int, x: Any) -> Any:
        if x is None:
            return None
        o, n = self.old[g], self.new[g]
        if not isinstance(x, Tensor) and x == o:
            return n
        return n * (x / o) if o else x

    def shared(self, x: Any) -> Any:
        """A learning rate shared by all groups (their ratios are equal: see ``_why_not``)."""
        return self(0, x) if x else x


def _children(s: Any) -> list[Any]:
    """The schedulers a ``SequentialLR`` / ``ChainedScheduler`` drives. torch keeps them only in
    ``_schedulers`` (the same name from torch 1.10 through 2.13); other schedulers have none."""
    return list(getattr(s, "_schedulers", None) or [])


def _tree(s: Any) -> list[Any]:
    """``s`` and every scheduler under it, depth first."""
    return [s] + [t for c in _children(s) for t in _tree(c)]


def _reference_lrs(old: Optimizer, schedulers: Sequence[Any]) -> list[Any]:
    """Per param group, the learning rate of ``old`` that the replacement's takes the place of."""
    for s in (t for sched in schedulers for t in _tree(sched)):
        if isinstance(s, S.OneCycleLR):
            return [g["max_lr"] for g in old.param_groups]
        if isinstance(s, S.CyclicLR):
            return list(s.max_lrs)
    return [g.get("initial_lr", g["lr"]) for g in old.param_groups]


def _why_not(s: Any, old: Optimizer, new: Optimizer) -> Optional[str]:
    """Why scheduler ``s`` cannot follow the replacement (None: it can)."""
    if len(old.param_groups) != len(new.param_groups):
        return (f"the module's {type(old).__name__} has {len(old.param_groups)} param group(s) and the replacement "
                f"{type(new).__name__} {len(new.param_groups)}, so the schedule's per-group factors have no "
                "counterpart (the optimizer= factory receives one list of parameters); use one param group in "
                "configure_optimizers, or drop optimizer= and return the optimizer you want from it")
    refs = _reference_lrs(old, [s]) if all(isinstance(t, S.LRScheduler) for t in _tree(s)) else []
    uniform = len({float(gn["lr"]) / float(r) if r else None for gn, r in zip(new.param_groups, refs)}) <= 1
    for t in _tree(s):
        if not isinstance(t, S.LRScheduler):
            return (f"{type(t).__name__} is not a torch.optim.lr_scheduler.LRScheduler, so which of its values are "
                    "learning rates is unknown; use a torch scheduler, or drop optimizer= and build your optimizer "
                    "in configure_optimizers")
        if getattr(t, "optimizer", None) is not old:
            return f"{type(t).__name__} drives another optimizer than the one configure_optimizers returned"
        if getattr(t, "cycle_momentum", False) and not {"momentum", "betas"} & set(new.defaults):
            return (f"{type(t).__name__} cycles the momentum (cycle_momentum=True) and {type(new).__name__} has "
                    "neither 'momentum' nor 'betas'; pass cycle_momentum=False")
        shared = [k for cls, keys in STATE_LR_SCALARS.items() if isinstance(t, cls) for k in keys
                  if getattr(t, k, None)]
        if shared and not uniform:
            return (f"{type(t).__name__}'s {', '.join(shared)} is one learning rate for all param groups, and the "
                    "replacement changes the groups' learning rates by different ratios")
    return None


def _retarget(s: Any, new: Optimizer, scale: _Scale) -> None:
    """Point ``s`` (and its children) at ``new`` and rescale its learning rates, through its state_dict."""
    for child in _children(s):
        _retarget(child, new, scale)
    lists = [k for cls, keys in STATE_LR_LISTS.items() if isinstance(s, cls) for k in keys]
    scalars = [k for cls, keys in STATE_LR_SCALARS.items() if isinstance(s, cls) for k in keys]
    state = s.state_dict()
    for key in lists:
        if isinstance(state.get(key), list):
            state[key] = [scale(g, x) for g, x in enumerate(state[key])]
    for key in scalars:
        if key in state:
            state[key] = scale.shared(state[key])
    if getattr(s, "cycle_momentum", False):
        state["use_beta1"] = "betas" in new.defaults
    s.load_state_dict(state)
    s.optimizer = new


def _copy_momentum(go: dict[str, Any], gn: dict[str, Any], old: Optimizer, new: Optimizer) -> None:
    """The momentum a scheduler cycles, and its bounds, as the module's group holds them."""
    for key in GROUP_MOMENTA:
        if key in go:
            gn[key] = go[key]
    m = go["betas"][0] if "betas" in old.defaults else go.get("momentum")
    if m is None:
        return
    if "betas" in new.defaults:
        gn["betas"] = (m, *gn["betas"][1:])
    else:
        gn["momentum"] = m


def _set(group: dict[str, Any], key: str, value: Any) -> None:
    """As schedulers write a group entry: in place when both are tensors."""
    if isinstance(group.get(key), Tensor) and value is not None:
        group[key].fill_(float(value))
    else:
        group[key] = value
