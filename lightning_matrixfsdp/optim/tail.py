"""The tail-optimizer base: a matrix optimizer on matrix roles, AdamW on everything else.

Every optimizer of this package is one object with two parts: a matrix optimizer
(Muon, Shampoo, SOAP) for the parameters with the matrix role, and exactly
``torch.optim.AdamW``'s single-tensor math for the rest (the tail role: norms,
biases, embeddings if so tagged). One object means one ``state_dict``, one set of
param groups for LR schedulers, and one ``step()`` that the owner of a role runs
without talking to any other rank: nothing here calls ``torch.distributed``.

:class:`TailOptimizer` holds what they share: group bookkeeping (validation, the
``lr_at_init`` record, defaults for groups of older pickles) and the one ``step()``,
which checks every parameter first (:func:`split_by_role`) and then hands each
group's matrices to the subclass's ``_matrix_group`` and the rest to ``_adamw_group``.

Routing (:func:`is_matrix_role`, written in ``groups.py``): a param group's ``"role"``
decides (``Muon(model)`` builds the Muon recipe's groups); a group without one goes by shape
(2-D: matrix), under every strategy alike. Empty non-owner placeholders and parameters without
a gradient are skipped.

Learning rate of the AdamW part (:func:`adamw_lr`): ``adamw_lr=None`` means "use the
group's ``lr``" (so it follows any LR scheduler trivially). An explicit ``adamw_lr``
is scaled by the factor the scheduler applied to ``lr``: the effective value is
``adamw_lr * group["lr"] / group["lr_at_init"]``, where ``lr_at_init`` is the group's
``lr`` recorded when the group was added (kept in the group, so it survives
``state_dict`` round trips). If ``lr_at_init`` is 0, ``adamw_lr`` is used unscaled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from lightning_matrixfsdp.runtime.placement import RoleKind
from lightning_matrixfsdp.runtime.tags import role_of, stack_of

from .groups import check_role, log, param_groups, routes_to_matrix, routing_line

__all__ = [
    "TailOptimizer",
    "adamw_lr",
    "adamw_update",
    "as_float",
    "check_adamw_group",
    "check_nonneg",
    "is_matrix_role",
    "keeps_whole_tp_state",
    "scalar_dtype",
    "split_by_role",
    "stack_pieces",
]

Routed = list[tuple[dict[str, Any], list[Tensor], list[Tensor]]]


# ---------------------------------------------------------------------- routing


def is_matrix_role(p: Tensor, group: dict[str, Any] | None = None) -> bool:
    """True if ``p`` (of ``group``) goes to the matrix optimizer (:func:`.groups.routes_to_matrix`)."""
    return routes_to_matrix(p, group or {})


def stack_pieces(p: Tensor, t: Tensor) -> list[tuple[int, slice, Tensor]]:
    """The matrices an expert stack ``p`` is stepped as, cut from ``t`` (its update, gradient or
    itself, shaped like ``p``): ``(expert, row slice, view)`` for every expert of ``p.shape[0]``
    (a local slice of the experts included) and every row block of its declaration. Each view is
    that block in ``nn.Linear``'s orientation ``(out_j, in)`` (``ExpertStack.pieces``): for a stack
    stored transposed or with interleaved blocks, a strided view of ``t``."""
    return stack_of(p).pieces(t)


def split_by_role(param_groups: list[dict[str, Any]], who: str, flattens: bool = False) -> Routed:
    """Per group: (group, matrix-role params, AdamW params) with a gradient to apply.

    ``flattens``: the optimizer takes a matrix role of more than two dimensions (a
    convolution kernel under ``flatten_conv``) as its ``(shape[0], -1)`` matrix.

    Checks everything before any state is touched, so a bad parameter raises without
    leaving the optimizer half-stepped. Empty non-owner placeholders are skipped.
    """
    routed: Routed = []
    for group in param_groups:
        matrices: list[Tensor] = []
        others: list[Tensor] = []
        for p in group["params"]:
            if p.grad is None or p.numel() == 0 or p.grad.numel() == 0:
                continue  # no gradient, or an empty non-owner placeholder
            if torch.is_complex(p):
                raise ValueError(f"{who} does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError(f"{who} does not support sparse gradients")
            if is_matrix_role(p, group):
                if role_of(p) is RoleKind.TAIL:
                    raise ValueError(f"{who}: a parameter of size {tuple(p.size())} is in a param group with "
                                     "role 'matrix', but the strategy's matrix_filter made it an AdamW (tail) "
                                     "parameter; drop matrix_filter or leave it out of the matrix group")
                stack = stack_of(p)
                if stack is not None:  # every optimizer here steps a stack as its experts' matrices
                    if not stack.fits(tuple(p.shape)):
                        raise ValueError(f"{who}: a parameter of size {tuple(p.size())} carries the expert-stack "
                                         f"declaration {stack} (three dimensions, {stack.rows} rows per expert "
                                         f"along dimension {stack.row_dim})")
                    matrices.append(p)
                    continue
                if p.ndim < 2 or (p.ndim > 2 and not flattens):
                    hint = (" (flatten_conv=True made this kernel a matrix role; of this library's optimizers "
                            "only Muon trains such roles, as their (shape[0], -1) matrix)" if p.ndim > 2 else "")
                    raise ValueError(
                        f"{who} updates 2D matrices only; a parameter routed to it as a matrix has "
                        f"size {tuple(p.size())}{hint}"
                    )
                matrices.append(p)
            else:
                if p.ndim > 2 and role_of(p) is None and group.get("role") is None:
                    _warn_untagged(who, p)
                others.append(p)
        routed.append((group, matrices, others))
    return routed


_UNTAGGED_WARNED: set[int] = set()


def _warn_untagged(who: str, p: Tensor) -> None:
    """Once per tensor: an untagged parameter of more than two dimensions goes to AdamW (a plain
    model, outside matrix_shard, which classifies and warns itself)."""
    if id(p) in _UNTAGGED_WARNED:
        return
    _UNTAGGED_WARNED.add(id(p))
    warnings.warn(
        f"{who} steps a parameter of size {tuple(p.size())} with AdamW: a tensor of more than two dimensions "
        "in a param group without a role is not a matrix. For mixture-of-experts stacks [E, m, n], build the "
        "optimizer from the module (e.g. Muon(model, ...)), so each expert is stepped as its own matrix under "
        "every strategy (docs/moe.md)", UserWarning, stacklevel=5)


# ---------------------------------------------------------------------- values


def as_float(x: float | Tensor) -> float:
    """A hyper-parameter as a Python float (a one-element tensor is read once)."""
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def scalar_dtype() -> torch.dtype:
    """dtype torch's Adam uses for ``state["step"]`` (non-fused, non-capturable)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def check_nonneg(name: str, value: Any, allow_none: bool = False) -> None:
    """Raise ValueError unless ``value`` is a number >= 0 (or None when allowed), as torch does."""
    if value is None and allow_none:
        return
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not 0.0 <= value:
        raise ValueError(f"{name} should be >= 0 but is: {value}")


def check_adamw_group(group: dict[str, Any]) -> None:
    """Raise ValueError for an AdamW-tail hyper-parameter torch's AdamW would reject."""
    check_nonneg("adamw_lr", group["adamw_lr"], allow_none=True)
    check_nonneg("adamw_eps", group["adamw_eps"])
    check_nonneg("adamw_weight_decay", group["adamw_weight_decay"], allow_none=True)
    betas = group["adamw_betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"adamw_betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= as_float(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


# ---------------------------------------------------------------------- AdamW


def adamw_lr(group: dict[str, Any]) -> float:
    """AdamW lr for this step: follows the scheduler's changes of ``group["lr"]``."""
    lr = as_float(group["lr"])
    tail_lr = group["adamw_lr"]
    if tail_lr is None:
        return lr
    tail_lr = as_float(tail_lr)
    initial = group.get("lr_at_init", lr)
    if initial == 0 or lr == initial:
        return tail_lr
    return tail_lr * (lr / initial)


def adamw_update(state_of: Any, group: dict[str, Any], params: list[Tensor], lr: float) -> None:
    """torch.optim.AdamW's single-tensor math on ``params`` with the group's ``adamw_*``
    hyper-parameters; state (``step``, ``exp_avg``, ``exp_avg_sq``) as torch keeps it."""
    beta1, beta2 = (as_float(b) for b in group["adamw_betas"])
    eps = group["adamw_eps"]
    weight_decay = group["adamw_weight_decay"]
    if weight_decay is None:
        weight_decay = group["weight_decay"]
    _warn_if_eps_vanishes(params, eps)
    for p in params:
        grad = p.grad
        state = state_of[p]
        if "step" not in state:
            # Same layout as torch's Adam: a CPU scalar step, moments like p.
            state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]

        step_t += 1
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)


_EPS_WARNED: set[tuple[torch.dtype, float]] = set()
_EPS_FINE: set[tuple[torch.dtype, float]] = set()  # checked once, so steps skip the check


def _warn_if_eps_vanishes(params: list[Tensor], eps: float) -> None:
    """Warn once per (dtype, eps) when AdamW's eps rounds to 0 in a parameter's dtype.

    With ``precision="16-true"`` the default 1e-8 is below float16's smallest
    subnormal: the denominator can then be exactly 0 and the tail turns to NaN after
    one step (torch.optim.AdamW behaves the same). The user should hear why.
    """
    for dtype in {p.dtype for p in params}:
        key = (dtype, eps)
        if key in _EPS_FINE or key in _EPS_WARNED or not dtype.is_floating_point:
            continue
        if not (eps > 0 and torch.tensor(eps, dtype=dtype).item() == 0):
            _EPS_FINE.add(key)
        else:
            _EPS_WARNED.add(key)
            warnings.warn(
                f"AdamW eps={eps:g} rounds to 0 in {dtype}: parameters trained by the AdamW tail can become "
                f"NaN once their squared-gradient average underflows. Pass a larger adamw_eps (e.g. 1e-4 for "
                f"float16) or keep those parameters in bfloat16/float32 (precision='bf16-true' or mixed).",
                RuntimeWarning,
                stacklevel=3,
            )


# ---------------------------------------------------------------------- the base


class TailOptimizer(torch.optim.Optimizer):
    """A matrix optimizer on matrix roles and AdamW on the rest, in one object.

    Subclasses define ``_validate_group(group)`` (raise ValueError for a bad
    hyper-parameter) and ``_matrix_group(group, params)`` (update one group's matrices),
    and may set :attr:`who` and override ``_begin_step()``. Defaults are validated at
    construction, groups added later the same way, and every group records
    ``lr_at_init`` (see :func:`adamw_lr`).
    """

    #: how errors name the optimizer; the class name unless overridden
    who: ClassVar[str | None] = None
    #: whether ``_matrix_group`` takes matrix roles of more than two dimensions (as their
    #: ``(shape[0], -1)`` matrix); the others refuse them with a message naming the parameter
    flattens_matrices: ClassVar[bool] = False
    #: where the state of a tensor-parallel split matrix role lives: whole on the matrix's TP
    #: stepper (True: Shampoo, SOAP, whose state is not elementwise) or sliced like the matrix on
    #: every TP rank (False: Muon's momentum). Checkpoints read it to restore state at any mesh.
    whole_tp_state: ClassVar[bool] = False

    def __init__(self, params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]],
                 defaults: dict[str, Any]) -> None:
        # Validate the defaults even if every group overrides them: a bad default is a
        # bug the user wants to hear about at construction.
        self._validate_group(defaults)
        names = None
        if isinstance(params, nn.Module):  # the Muon recipe's groups, alike under every strategy
            names = {id(p): fqn for fqn, p in params.named_parameters()}
            params = param_groups(params)
        super().__init__(params, defaults)
        log.info(routing_line(self._name(), self.param_groups, names))

    # ------------------------------------------------------------------ groups

    def _validate_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _name(self) -> str:
        return self.who or type(self).__name__

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Fill defaults, validate, reject complex params, record ``lr_at_init``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_role(group, self._name())
            self._validate_group(group)
            if any(torch.is_complex(p) for p in group["params"]):
                raise ValueError(f"{self._name()} does not support complex parameters")
        except ValueError:
            self.param_groups.pop()  # leave the optimizer as it was
            raise
        group.setdefault("lr_at_init", as_float(group["lr"]))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle / load older objects: give every group the keys ``step()`` reads."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            group.setdefault("lr_at_init", as_float(group["lr"]))

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local optimization step (never communicates)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        routed = split_by_role(self.param_groups, self._name(), self.flattens_matrices)
        self._begin_step()
        for group, matrices, others in routed:
            if matrices:
                self._matrix_group(group, matrices)
            if others:
                self._adamw_group(group, others)
        return loss

    def _begin_step(self) -> None:
        """Called once per step after every parameter passed the checks, before any update."""

    def _matrix_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        raise NotImplementedError

    def _adamw_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """torch.optim.AdamW's single-tensor update (amsgrad=False, maximize=False)."""
        adamw_update(self.state, group, params, adamw_lr(group))


def keeps_whole_tp_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps a TP-split matrix role's state whole on the matrix's TP stepper
    (:attr:`TailOptimizer.whole_tp_state`). An optimizer of another package steps each fragment
    as a tensor of its own, so its state is sliced like the parameter."""
    return isinstance(optimizer, TailOptimizer) and type(optimizer).whole_tp_state
