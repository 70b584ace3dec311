"""Muon for matrix roles plus AdamW for everything else, in one optimizer object.

Matrix parameters get exactly the math of ``torch.optim.Muon``; the rest (the tail
role: norms, biases, embeddings if so tagged) gets exactly the math of
``torch.optim.AdamW`` (single-tensor path). One object means one ``state_dict``,
one set of param groups for LR schedulers, and one ``step()`` that the owner of a
role can run without talking to any other rank: nothing here calls
``torch.distributed``.

Routing (:func:`uses_muon`): a parameter tagged by the sharding runtime with
``_mfsdp_role`` follows its tag (``"matrix"`` -> Muon, anything else -> AdamW);
an untagged parameter goes to Muon iff it is 2D. Resident tensors that a rank does
not own are empty (``numel() == 0``) and are skipped, as are parameters without a
gradient.

Learning rate of the AdamW part: ``adamw_lr=None`` means "use the group's ``lr``"
(so it follows any LR scheduler trivially). With an explicit ``adamw_lr`` it is
scaled by the same factor the scheduler applied to ``lr``: the effective value is
``adamw_lr * group["lr"] / group["lr_at_init"]``, where ``lr_at_init`` is the
group's ``lr`` recorded when the group was added (kept in the group, so it
survives ``state_dict`` round trips). If ``lr_at_init`` is 0, ``adamw_lr`` is used
unscaled.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .fused import momentum_update
from .orthogonalize import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    SYMMETRIC_MIN_ROWS,
    gram_polar_express,
    newton_schulz,
    newton_schulz_batched,
    polar_express,
)

__all__ = ["MATRIX_ROLE", "Muon", "ORTHOGONALIZERS", "TailOptimizer", "adjust_lr", "uses_muon"]

#: Value of ``p._mfsdp_role`` that selects Muon; every other tag selects AdamW.
MATRIX_ROLE = "matrix"

#: Valid ``orthogonalizer`` names. "newton_schulz" is bitwise torch.optim.Muon;
#: "batched" is the same math with same-shape matrices of a group stacked;
#: "polar_express" and "gram_polar_express" are opt-in faster/more accurate schemes.
ORTHOGONALIZERS = ("newton_schulz", "batched", "polar_express", "gram_polar_express", "fast")

#: "fast" picks per matrix: the Gram-space iteration where the aspect ratio is at
#: least this (it saves FLOPs there), Polar Express otherwise.
FAST_GRAM_MIN_ASPECT = 4

#: Most elements stacked into one batched Newton-Schulz (bounds the transient copies:
#: 256 MiB of bfloat16 per stack).
BATCH_MAX_ELEMENTS = 2**27

#: Momentum and Nesterov update in one Triton pass on CUDA (:mod:`.fused`); measured
#: bitwise equal to torch's two lerps on an H200 (docs/benchmarks.md).
FUSED_MOMENTUM = True

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def uses_muon(p: Tensor) -> bool:
    """True if ``p`` is trained by Muon: its ``_mfsdp_role`` tag if any, else ``ndim == 2``."""
    role = getattr(p, "_mfsdp_role", None)
    if role is None:
        return p.ndim == 2
    role = getattr(role, "value", role)  # accept an Enum whose value is the name
    return role == MATRIX_ROLE


def split_by_role(
    param_groups: list[dict[str, Any]], who: str
) -> list[tuple[dict[str, Any], list[Tensor], list[Tensor]]]:
    """Per group: (group, matrix-role params, AdamW params) with a gradient to apply.

    Checks everything before any state is touched, so a bad parameter raises without
    leaving the optimizer half-stepped. Empty non-owner placeholders are skipped.
    """
    routed: list[tuple[dict[str, Any], list[Tensor], list[Tensor]]] = []
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
            if uses_muon(p):
                if p.ndim != 2:
                    raise ValueError(
                        f"{who} updates 2D matrices only; a parameter routed to it as a matrix has "
                        f"size {tuple(p.size())}"
                    )
                matrices.append(p)
            else:
                others.append(p)
        routed.append((group, matrices, others))
    return routed


def adamw_lr(group: dict[str, Any]) -> float:
    """AdamW lr for this step: follows the scheduler's changes of ``group["lr"]``."""
    lr = _as_float(group["lr"])
    tail_lr = group["adamw_lr"]
    if tail_lr is None:
        return lr
    tail_lr = _as_float(tail_lr)
    initial = group.get("lr_at_init", lr)
    if initial == 0 or lr == initial:
        return tail_lr
    return tail_lr * (lr / initial)


def adamw_update(state_of: Any, group: dict[str, Any], params: list[Tensor], lr: float) -> None:
    """torch.optim.AdamW's single-tensor math on ``params`` with the group's ``adamw_*``
    hyper-parameters; state (``step``, ``exp_avg``, ``exp_avg_sq``) as torch keeps it.
    Shared by every optimizer here that trains the tail with AdamW."""
    beta1, beta2 = (_as_float(b) for b in group["adamw_betas"])
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
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
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


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Shape-dependent Muon learning rate, as torch.optim.Muon computes it."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    return lr * ratio


def _scalar_dtype() -> torch.dtype:
    """dtype torch's Adam uses for ``state["step"]`` (non-fused, non-capturable)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _as_float(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _check_nonneg(name: str, value: Any, allow_none: bool = False) -> None:
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
    _check_nonneg("adamw_lr", group["adamw_lr"], allow_none=True)
    _check_nonneg("adamw_eps", group["adamw_eps"])
    _check_nonneg("adamw_weight_decay", group["adamw_weight_decay"], allow_none=True)
    betas = group["adamw_betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"adamw_betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= _as_float(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


class TailOptimizer(torch.optim.Optimizer):
    """Group bookkeeping shared by every optimizer here with an AdamW tail.

    Subclasses define ``_validate_group(group)`` and :attr:`who`; groups added later
    are validated the same way, and every group records ``lr_at_init`` (see
    :func:`adamw_lr`).
    """

    #: how errors name the optimizer; the class name unless overridden
    who: ClassVar[str | None] = None

    def _validate_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _name(self) -> str:
        return self.who or type(self).__name__

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Fill defaults, validate, reject complex params, record ``lr_at_init``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._validate_group(group)
            if any(torch.is_complex(p) for p in group["params"]):
                raise ValueError(f"{self._name()} does not support complex parameters")
        except ValueError:
            self.param_groups.pop()  # leave the optimizer as it was
            raise
        group.setdefault("lr_at_init", _as_float(group["lr"]))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle / load older objects: give every group the keys ``step()`` reads."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            group.setdefault("lr_at_init", _as_float(group["lr"]))


class Muon(TailOptimizer):
    """Muon on matrix parameters, AdamW on the rest; no communication in ``step()``.

    Args:
        params: parameters or param groups (any group may override any default).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
            adjust_lr_fn: as ``torch.optim.Muon`` (same defaults, same math).
        adamw_lr: AdamW learning rate; ``None`` -> the group's ``lr``. Follows LR
            schedulers (see the module docstring).
        adamw_betas, adamw_eps: AdamW betas and epsilon.
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` -> ``weight_decay``.
        orthogonalizer: one of :data:`ORTHOGONALIZERS`. With "polar_express" /
            "gram_polar_express" / "fast", ``ns_coefficients`` is ignored and
            ``ns_steps`` iterations of the Polar Express schedule run instead
            ("fast" uses the Gram-space iteration for matrices with an aspect
            ratio of at least :data:`FAST_GRAM_MIN_ASPECT`).
        symmetric_blocks: row blocks for the symmetric products ``X X^T`` and
            ``A A`` of the iteration (only their upper block triangle is
            multiplied); ``None`` = automatic: 1 (torch.optim.Muon's exact ops) on
            CPU and for small matrices, several on CUDA. See
            :func:`~lightning_matrixfsdp.optim.orthogonalize.symmetric_addmm`.
        batch_shapes: stack same-shape matrices whose smaller side is below 4096
            into one batched Newton-Schulz (``bmm``), in stacks of at most
            :data:`BATCH_MAX_ELEMENTS`; ``None`` = automatic: on CUDA (measured
            bitwise equal to the per-matrix iteration on an H200, and 3.6x faster
            for a step over 1024-wide matrices), off on CPU. Only with
            ``orthogonalizer="newton_schulz"``.
    """

    who = "Muon (with its AdamW tail)"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        orthogonalizer: str = "newton_schulz",
        symmetric_blocks: int | None = None,
        batch_shapes: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
            "orthogonalizer": orthogonalizer,
            "symmetric_blocks": symmetric_blocks,
            "batch_shapes": batch_shapes,
        }
        # Validate the defaults even if every group overrides them: a bad default
        # is a bug the user wants to hear about at construction.
        self._validate_group(defaults)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    @staticmethod
    def _validate_group(group: dict[str, Any]) -> None:
        """Raise ValueError for any hyper-parameter torch's Muon/AdamW would reject."""
        _check_nonneg("Learning rate", group["lr"])
        _check_nonneg("momentum", group["momentum"])
        _check_nonneg("weight decay", group["weight_decay"])
        _check_nonneg("eps", group["eps"])
        if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {group['adjust_lr_fn']} is not supported; "
                f"valid: {_ADJUST_LR_FNS}"
            )
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100), got {steps!r}")
        check_adamw_group(group)
        blocks = group["symmetric_blocks"]
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
            raise ValueError(f"symmetric_blocks must be a positive int or None, got {blocks!r}")
        if group["batch_shapes"] not in (None, True, False):
            raise ValueError(f"batch_shapes must be True, False or None, got {group['batch_shapes']!r}")
        if group["orthogonalizer"] not in ORTHOGONALIZERS:
            raise ValueError(
                f"Unknown orthogonalizer {group['orthogonalizer']!r}; valid: {', '.join(ORTHOGONALIZERS)}"
            )

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local optimization step (never communicates)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        routed = split_by_role(self.param_groups, self._name())
        for group, matrices, others in routed:
            if matrices:
                self._muon_group(group, matrices)
            if others:
                self._adamw_group(group, others)
        return loss

    def _muon_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """torch.optim.Muon's update for every matrix of one group.

        Works bucket by bucket (one matrix, or a stack of same-shape matrices: see
        :meth:`_buckets`) so the transient copies never exceed one bucket's size. (Spreading
        buckets over two CUDA streams was measured on an H200 and gained nothing:
        docs/decisions.md.)
        """
        for bucket in self._buckets(group, params):
            self._muon_bucket(group, bucket)

    def _muon_bucket(self, group: dict[str, Any], bucket: list[Tensor]) -> None:
        """Momentum, orthogonalization and the update of one bucket (torch's op order)."""
        lr = _as_float(group["lr"])
        weight_decay = group["weight_decay"]
        momentum = group["momentum"]
        nesterov = group["nesterov"]
        updates: list[Tensor] = []
        for p in bucket:
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            updates.append(momentum_update(grad, state["momentum_buffer"], momentum, nesterov, FUSED_MOMENTUM))
        decay = 1 - lr * weight_decay
        for p, update in zip(bucket, self._orthogonalize(group, updates)):
            if decay != 1:  # multiplying by 1 is the identity: skip a read and write of p
                p.mul_(decay)
            p.add_(update, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    @staticmethod
    def _buckets(group: dict[str, Any], params: list[Tensor]) -> list[list[Tensor]]:
        """Matrices orthogonalized together: stacks of one (shape, device) or singletons.

        "batched" stacks every shape; "newton_schulz" with ``batch_shapes`` stacks those
        below :data:`SYMMETRIC_MIN_ROWS` (larger ones fill the GPU alone and use the
        symmetric products). A bf16 momentum buffer without Nesterov is its own update,
        which torch normalizes in place; those stay singletons so that stays bitwise.
        """
        name = group["orthogonalizer"]
        batch = group.get("batch_shapes")
        if name == "newton_schulz" and batch is None:
            batch = bool(params) and params[0].device.type == "cuda"
        if name != "batched" and not (name == "newton_schulz" and batch):
            return [[p] for p in params]
        aliased = not group["nesterov"]
        stacks: dict[tuple[torch.Size, torch.device], list[Tensor]] = defaultdict(list)
        single: list[list[Tensor]] = []
        for p in params:
            small = min(p.shape) < SYMMETRIC_MIN_ROWS or name == "batched"
            if not small or (aliased and p.grad.dtype == torch.bfloat16):
                single.append([p])
            else:
                stacks[(p.shape, p.device)].append(p)
        buckets = list(single)
        for (shape, _), members in stacks.items():
            per_stack = max(1, BATCH_MAX_ELEMENTS // max(1, shape.numel()))
            buckets += [members[i:i + per_stack] for i in range(0, len(members), per_stack)]
        return buckets

    @staticmethod
    def _orthogonalize(group: dict[str, Any], updates: list[Tensor]) -> list[Tensor]:
        """Apply the group's orthogonalizer to one bucket of momentum updates."""
        name = group["orthogonalizer"]
        coefficients = tuple(group["ns_coefficients"])
        steps, eps = group["ns_steps"], group["eps"]
        blocks = group.get("symmetric_blocks")
        if name == "newton_schulz":
            if len(updates) > 1:  # a stack from _buckets (batch_shapes)
                return newton_schulz_batched(updates, coefficients, steps, eps)
            return [newton_schulz(u, coefficients, steps, eps, blocks) for u in updates]
        if name == "batched":
            return newton_schulz_batched(updates, coefficients, steps, eps)
        if name == "polar_express":
            return [polar_express(u, steps, eps, blocks=blocks) for u in updates]
        if name == "gram_polar_express":
            return [gram_polar_express(u, steps, eps, blocks=blocks) for u in updates]
        if name == "fast":
            return [gram_polar_express(u, steps, eps, blocks=blocks)
                    if max(u.shape) >= FAST_GRAM_MIN_ASPECT * min(u.shape)
                    else polar_express(u, steps, eps, blocks=blocks) for u in updates]
        raise ValueError(f"Unknown orthogonalizer {name!r}; valid: {', '.join(ORTHOGONALIZERS)}")

    def _adamw_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """torch.optim.AdamW's single-tensor update (amsgrad=False, maximize=False)."""
        adamw_update(self.state, group, params, adamw_lr(group))
