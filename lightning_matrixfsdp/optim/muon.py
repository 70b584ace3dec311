"""Muon for matrix roles plus AdamW for everything else, in one optimizer object.

Matrix parameters get exactly the math of ``torch.optim.Muon``; the rest gets exactly
the math of ``torch.optim.AdamW`` (single-tensor path). Routing, the AdamW part, the
group bookkeeping and ``step()`` are the shared :class:`~.tail.TailOptimizer`'s (see
that module for the routing rule and how ``adamw_lr`` follows LR schedulers); this
file holds Muon's own part: hyper-parameter checks, momentum, the choice of
orthogonalizer and how matrices are stacked for it.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .fast import FAST_SCHEDULE, fast_newton_schulz, fast_newton_schulz_batched
from .fused import decay_add_, momentum_update
from .iteration import orthogonalize_stack
from .orthogonalize import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    SYMMETRIC_MIN_ROWS,
    gram_polar_express,
    newton_schulz,
    newton_schulz_batched,
    polar_express,
)
from lightning_matrixfsdp.runtime.tags import stack_of, tp_of
from lightning_matrixfsdp.runtime.tp.step_comm import gather_to_steppers, scatter_from_steppers

from .tail import TailOptimizer, as_float, check_adamw_group, check_nonneg, is_matrix_role, stack_pieces

__all__ = ["Muon", "ORTHOGONALIZERS", "adjust_lr", "uses_muon"]

#: Valid ``orthogonalizer`` names. "newton_schulz" is bitwise torch.optim.Muon;
#: "batched" is the same math with same-shape matrices of a group stacked;
#: "fast" is four iterations fitted to the default's five (:mod:`.fast`: 4/5 of the work, the
#: same update size); "polar_express" and "gram_polar_express" are opt-in schemes closer to
#: ``U V^T`` (other training math).
ORTHOGONALIZERS = ("newton_schulz", "batched", "polar_express", "gram_polar_express", "fast")
GRAM_WARNING = (
    'Muon(orthogonalizer="gram_polar_express") is experimental: in bfloat16 training its Gram-space '
    "iteration diverged in the project's convergence benchmark (docs/benchmarks.md \"Convergence\").")

#: Most elements stacked into one batched Newton-Schulz (bounds the transient copies:
#: 256 MiB of bfloat16 per stack).
BATCH_MAX_ELEMENTS = 2**27

#: Momentum and Nesterov update in one Triton pass on CUDA (:mod:`.fused`); measured
#: bitwise equal to torch's two lerps on an H200 (docs/benchmarks.md).
FUSED_MOMENTUM = True

#: Expert stacks whose pieces share one shape are orthogonalized as views of the stack's update
#: (:meth:`Muon._step_stack_whole`) rather than piece by piece into a stacked copy.
STACK_WHOLE = True
_STACKED = ("newton_schulz", "fast", "batched")
#: In that path on CUDA, the momentum kernel writes the update in bf16 (the cast it would get
#: next) and the weight decay and update are one Triton pass (:func:`.fused.decay_add_`).
FUSED_UPDATE = True

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def uses_muon(p: Tensor, group: dict[str, Any] | None = None) -> bool:
    """True if ``p`` (of ``group``) is trained by Muon: the group's ``"role"`` if it has one, else by
    shape (:func:`~.groups.routes_to_matrix`)."""
    return is_matrix_role(p, group)


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


class Muon(TailOptimizer):
    """Muon on matrix parameters, AdamW on the rest; no communication in ``step()``.

    Args:
        params: a module (its parameters in the Muon recipe's groups, :func:`~.groups.param_groups`:
            the same roles under every strategy), or parameters (by shape: 2-D on Muon), or param
            groups (any group may override any default, and set ``"role"``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
            adjust_lr_fn: as ``torch.optim.Muon`` (same defaults, same math).
        adamw_lr: AdamW learning rate; ``None`` -> the group's ``lr``. Follows LR
            schedulers (see :mod:`.tail`).
        adamw_betas, adamw_eps: AdamW betas and epsilon.
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` -> ``weight_decay``.
        orthogonalizer: one of :data:`ORTHOGONALIZERS`. With "polar_express" /
            "gram_polar_express", ``ns_coefficients`` is ignored and ``ns_steps``
            iterations of the Polar Express schedule run instead ("gram_polar_express"
            warns: experimental). "fast" runs the four fitted iterations of :mod:`.fast`
            in place of the default's five; it needs the default ``ns_coefficients`` and
            ``ns_steps`` (it replaces exactly that iteration) and raises otherwise.
        symmetric_blocks: row blocks for the symmetric products ``X X^T`` and
            ``A A`` of the iteration (only their upper block triangle is
            multiplied), of single matrices and of batches; ``None`` = automatic: 1
            (torch.optim.Muon's exact ops) on CPU and for small matrices, several on
            CUDA (3 from 4096 rows, 4 for batches from 2048 rows). See
            :func:`~lightning_matrixfsdp.optim.orthogonalize.symmetric_addmm`.
        batch_shapes: stack same-shape matrices whose smaller side is below 4096
            into one batched Newton-Schulz (``bmm``), in stacks of at most
            :data:`BATCH_MAX_ELEMENTS`; ``None`` = automatic: on CUDA (measured
            bitwise equal to the per-matrix iteration on an H200, and faster there:
            docs/decisions.md), off on CPU. Only with
            ``orthogonalizer="newton_schulz"`` or ``"fast"``.
    """

    who = "Muon (with its AdamW tail)"
    flattens_matrices = True  # a convolution kernel role (flatten_conv) is its (out, -1) matrix

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]],
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
        super().__init__(params, defaults)
        chosen = {g["orthogonalizer"] for g in self.param_groups}
        if "gram_polar_express" in chosen:
            warnings.warn(GRAM_WARNING, UserWarning, stacklevel=2)

    # ------------------------------------------------------------------ groups

    @staticmethod
    def _validate_group(group: dict[str, Any]) -> None:
        """Raise ValueError for any hyper-parameter torch's Muon/AdamW would reject."""
        check_nonneg("Learning rate", group["lr"])
        check_nonneg("momentum", group["momentum"])
        check_nonneg("weight decay", group["weight_decay"])
        check_nonneg("eps", group["eps"])
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
        if group["orthogonalizer"] == "fast" and (
            steps != DEFAULT_NS_STEPS or tuple(float(c) for c in coefficients) != DEFAULT_NS_COEFFICIENTS
        ):
            raise ValueError(
                f'orthogonalizer="fast" replaces the default iteration (ns_steps={DEFAULT_NS_STEPS}, '
                f"ns_coefficients={DEFAULT_NS_COEFFICIENTS}) by four fitted ones; got ns_steps={steps!r}, "
                f"ns_coefficients={tuple(coefficients)!r}. Use the defaults with \"fast\", or "
                'orthogonalizer="newton_schulz" to run your own iteration'
            )

    # -------------------------------------------------------------------- step

    def _matrix_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """torch.optim.Muon's update for every matrix of one group.

        Works bucket by bucket (one matrix, or a stack of same-shape matrices: see
        :meth:`_buckets`) so the transient copies never exceed one bucket's size. (Spreading
        buckets over two CUDA streams was measured on an H200 and gained nothing:
        docs/decisions.md.)
        """
        split = [p for p in params if tp_of(p) is not None]
        if split:  # fragments of tensor-parallel matrices: each orthogonalized whole, on one TP rank
            self._muon_tp(group, split)
            params = [p for p in params if tp_of(p) is None]
        for p in params:
            if stack_of(p) is not None:
                self._muon_stack(group, p)
        params = [p for p in params if stack_of(p) is None]
        for bucket in self._buckets(group, params):
            self._muon_bucket(group, bucket)

    def _muon_tp(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """torch.optim.Muon's update of whole matrices held as TP fragments: the momentum (elementwise)
        stays sliced on every TP rank; the blended fragments go to each matrix's TP stepper, which
        orthogonalizes the whole matrix once; every TP rank gets its slice of the result back and
        applies it with the whole matrix's learning-rate adjustment. Bitwise the whole-matrix step."""
        lr = as_float(group["lr"])
        frags = [tp_of(p) for p in params]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            updates.append(momentum_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"],
                                           FUSED_MOMENTUM))
        wholes = gather_to_steppers(frags, updates)
        results = [None if w is None else self.orthogonalize(group, [w])[0] for w in wholes]
        dtypes = [self._ortho_dtype(group, u.dtype) for u in updates]
        for r, dtype in zip(results, dtypes):
            if r is not None and r.dtype != dtype:
                raise RuntimeError(f"the orthogonalizer returned {r.dtype}, not {dtype} as for a probe matrix")
        slices = scatter_from_steppers(frags, results, dtypes, params[0].device)
        decay = 1 - lr * group["weight_decay"]
        for p, f, piece in zip(params, frags, slices):
            if decay != 1:
                p.mul_(decay)
            p.add_(piece.reshape(p.shape), alpha=-adjust_lr(lr, group["adjust_lr_fn"], torch.Size(f.global_shape)))

    def _muon_stack(self, group: dict[str, Any], p: Tensor) -> None:
        """torch.optim.Muon's update of an expert stack as ``p.shape[0]`` independent matrices, each
        as its row blocks (a fused gate/up: two matrices): the momentum, weight decay and update are
        elementwise, so one op over the stack is each matrix's op; Newton-Schulz and the learning-rate
        adjustment are per matrix, from that block's own (rows, cols) in ``nn.Linear``'s orientation
        (out, in), whatever the stored layout (GPT-OSS: ``[E, in, out]``, gate/up interleaved). Bitwise
        torch.optim.Muon on the separate 2-D ``(out, in)`` matrices. With ``batch_shapes`` (on CUDA by default) or
        ``orthogonalizer="batched"``, the matrices of one shape are orthogonalized as one batched
        iteration (:meth:`_orthogonalize_batch`: where ``_buckets`` would batch separate matrices of
        that shape, the same computation), otherwise one by one."""
        lr = as_float(group["lr"])
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        if self._step_stack_whole(group, p):
            return
        update = momentum_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"],
                                 FUSED_MOMENTUM)
        # each piece in nn.Linear's orientation (out, in), contiguous as a separate matrix's update is
        # (a no-op for contiguous row blocks; a copy for a stack stored transposed or interleaved)
        pieces = [piece.contiguous() for _, _, piece in stack_pieces(p, update)]
        results = self._orthogonalize_batch(group, pieces)
        decay = 1 - lr * group["weight_decay"]
        if decay != 1:
            p.mul_(decay)
        for (_, _, target), out in zip(stack_pieces(p, p), results):  # lr adjusted from (out, in)
            target.add_(out, alpha=-adjust_lr(lr, group["adjust_lr_fn"], out.shape))

    def _step_stack_whole(self, group: dict[str, Any], p: Tensor) -> bool:
        """The whole step of an expert stack whose pieces share one shape, where
        :meth:`_orthogonalize_batch` would batch them all: momentum (on CUDA written straight
        in bf16, the iteration's dtype), one batched iteration per chunk of pieces viewed in
        place in the stack's update (no per-piece cast or stacking copy), and the weight decay
        and update as one pass per chunk (one learning rate: one shape). The same numbers as the
        piece-by-piece path: the views hold the same entries and the ops are the batched ones.
        Returns False (nothing done) where it does not apply."""
        stack, grad, buf = stack_of(p), p.grad, self.state[p]["momentum_buffer"]
        name = group["orthogonalizer"]
        if not STACK_WHOLE or type(self).orthogonalize is not Muon.orthogonalize or name not in _STACKED:
            return False
        if len(set(stack.blocks)) != 1 or not (p.is_contiguous() and grad.is_contiguous() and buf.is_contiguous()):
            return False
        if stack.transposed or stack.interleaved:  # its pieces are not [-1, rows, cols] views of the stack
            return False
        rows, cols = stack.blocks[0], p.shape[-1]
        batch = group.get("batch_shapes")
        if name != "batched" and (min(rows, cols) >= SYMMETRIC_MIN_ROWS or batch is False
                                  or (batch is None and not p.is_cuda)):
            return False
        if not group["nesterov"] and grad.dtype == torch.bfloat16:
            return False  # torch normalizes the aliased buffer in place: the piece path keeps that
        update = momentum_update(grad, buf, group["momentum"], group["nesterov"], FUSED_MOMENTUM,
                                 torch.bfloat16 if FUSED_UPDATE else None)
        lr = as_float(group["lr"])
        schedule = FAST_SCHEDULE if name == "fast" else (
            [tuple(float(c) for c in group["ns_coefficients"])] * group["ns_steps"])
        decay = 1 - lr * group["weight_decay"]
        alpha = -adjust_lr(lr, group["adjust_lr_fn"], torch.Size((rows, cols)))
        pieces, target = update.view(-1, rows, cols), p.view(-1, rows, cols)
        per_stack = max(1, BATCH_MAX_ELEMENTS // (rows * cols))
        for k in range(0, pieces.size(0), per_stack):
            out = orthogonalize_stack(pieces[k:k + per_stack], schedule, group["eps"], group.get("symmetric_blocks"),
                                      contiguous=not FUSED_UPDATE)  # decay_add_ reads a transposed result as is
            chunk = target[k:k + per_stack]
            if FUSED_UPDATE:
                decay_add_(chunk, out, decay, alpha)  # each chunk's weights read and written once
            else:
                if decay != 1:
                    chunk.mul_(decay)
                chunk.add_(out, alpha=alpha)
        return True

    def _orthogonalize_batch(self, group: dict[str, Any], updates: list[Tensor]) -> list[Tensor]:
        """Orthogonalize separate 2-D matrices, batching those of one shape exactly where
        :meth:`_buckets` would batch separate parameters of that shape (same limits)."""
        name = group["orthogonalizer"]
        batch = group.get("batch_shapes")
        if name in ("newton_schulz", "fast") and batch is None:
            batch = bool(updates) and updates[0].device.type == "cuda"
        batching = name == "batched" or (name in ("newton_schulz", "fast") and batch)
        aliased = not group["nesterov"]
        results: list[Any] = [None] * len(updates)
        stacks: dict[torch.Size, list[int]] = defaultdict(list)
        for i, u in enumerate(updates):
            small = min(u.shape) < SYMMETRIC_MIN_ROWS or name == "batched"
            if batching and small and not (aliased and u.dtype == torch.bfloat16):
                stacks[u.shape].append(i)
            else:
                results[i] = self.orthogonalize(group, [u])[0]
        for shape, members in stacks.items():
            per_stack = max(1, BATCH_MAX_ELEMENTS // max(1, shape.numel()))
            for k in range(0, len(members), per_stack):
                chunk = members[k:k + per_stack]
                for i, out in zip(chunk, self.orthogonalize(group, [updates[i] for i in chunk])):
                    results[i] = out
        return results

    def _ortho_dtype(self, group: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
        """The dtype the group's orthogonalizer returns for updates of ``dtype`` (a 2 x 2 probe,
        cached): what a TP rank receives its slice in, known before the stepper computes it."""
        cache: dict[tuple, torch.dtype] = self.__dict__.setdefault("_ortho_dtypes", {})
        key = (group["orthogonalizer"], dtype)
        if key not in cache:
            cache[key] = self.orthogonalize(group, [torch.eye(2, dtype=dtype)])[0].dtype
        return cache[key]

    def _muon_bucket(self, group: dict[str, Any], bucket: list[Tensor]) -> None:
        """Momentum, orthogonalization and the update of one bucket (torch's op order)."""
        lr = as_float(group["lr"])
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
        flat = [u if u.ndim == 2 else u.reshape(u.shape[0], -1) for u in updates]
        for p, update in zip(bucket, self.orthogonalize(group, flat)):
            if decay != 1:  # multiplying by 1 is the identity: skip a read and write of p
                p.mul_(decay)
            p.add_(update.reshape(p.shape), alpha=-adjust_lr(lr, group["adjust_lr_fn"], update.shape))

    @staticmethod
    def _buckets(group: dict[str, Any], params: list[Tensor]) -> list[list[Tensor]]:
        """Matrices orthogonalized together: stacks of one (shape, device) or singletons.

        "batched" stacks every shape; "newton_schulz" and "fast" with ``batch_shapes`` stack
        those below :data:`SYMMETRIC_MIN_ROWS` (larger ones fill the GPU alone and use the
        symmetric products). A bf16 momentum buffer without Nesterov is its own update,
        which torch normalizes in place; those stay singletons so that stays bitwise.
        """
        name = group["orthogonalizer"]
        batch = group.get("batch_shapes")
        if name in ("newton_schulz", "fast") and batch is None:
            batch = bool(params) and params[0].device.type == "cuda"
        if name != "batched" and not (name in ("newton_schulz", "fast") and batch):
            return [[p] for p in params]
        aliased = not group["nesterov"]
        stacks: dict[tuple[torch.Size, torch.device], list[Tensor]] = defaultdict(list)
        single: list[list[Tensor]] = []
        for p in params:
            small = min(p.shape[0], p.numel() // p.shape[0]) < SYMMETRIC_MIN_ROWS or name == "batched"
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
    def orthogonalize(group: dict[str, Any], updates: list[Tensor]) -> list[Tensor]:
        """Apply the group's orthogonalizer to one bucket of momentum updates (2-D, same shape
        if more than one); a subclass may override it to try another iteration."""
        name = group["orthogonalizer"]
        coefficients = tuple(group["ns_coefficients"])
        steps, eps = group["ns_steps"], group["eps"]
        blocks = group.get("symmetric_blocks")
        if name == "newton_schulz":
            if len(updates) > 1:  # a stack from _buckets (batch_shapes)
                return newton_schulz_batched(updates, coefficients, steps, eps, blocks)
            return [newton_schulz(u, coefficients, steps, eps, blocks) for u in updates]
        if name == "batched":
            return newton_schulz_batched(updates, coefficients, steps, eps, blocks)
        if name == "polar_express":
            return [polar_express(u, steps, eps, blocks=blocks) for u in updates]
        if name == "gram_polar_express":
            return [gram_polar_express(u, steps, eps, blocks=blocks) for u in updates]
        if name == "fast":
            if len(updates) > 1:
                return fast_newton_schulz_batched(updates, eps, blocks)
            return [fast_newton_schulz(u, eps, blocks) for u in updates]
        raise ValueError(f"Unknown orthogonalizer {name!r}; valid: {', '.join(ORTHOGONALIZERS)}")
