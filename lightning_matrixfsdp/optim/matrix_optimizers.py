"""Shampoo and SOAP for matrix roles plus AdamW for everything else, one optimizer object each.

Owner placement keeps every matrix role whole on one rank, so a single-device matrix
optimizer runs there unchanged: no distributed variant, no communication in ``step()``.
We therefore wrap a published implementation instead of writing our own.

Library choice: ``pytorch_optimizer`` (PyPI ``pytorch-optimizer``, kozistr, Apache-2.0)
---------------------------------------------------------------------------------------
* correctness: its ``SOAP`` follows the reference code of Vyas et al. (arXiv:2409.11321)
  step for step (Adam in the eigenbasis of the two Kronecker factors; ``eigh`` at start,
  one power iteration + QR every ``precondition_frequency`` steps). Its
  ``ScalableShampoo`` ports Google's ``distributed_shampoo`` (Anil et al.,
  arXiv:2002.09018): blocked Kronecker statistics, inverse p-th roots by coupled Newton
  (or SVD), layer-wise grafting, delayed start, infrequent root computation: the Shampoo
  people actually train with, not the 2018 "SVD every step" variant.
* upkeep: several releases a year, one shared base class and test suite for ~100 optimizers.
* weight: plain eager PyTorch, depends on torch and numpy only; imported lazily (first
  construction), so ``import lightning_matrixfsdp`` neither needs it nor pays its import time.
* speed: per-matrix eager kernels (matmul, eigh, QR, Newton iterations): exactly the work
  an owner of a whole matrix has to do; nothing is compiled, so no warm-up or recompiles.
Not chosen: ``heavyball`` (BSD-2, maintained, likely faster on GPU once compiled, but
compile-first: ``torch.compile(mode="max-autotune...")`` on the step path, ``numpy>=2.3``,
a multi-tensor state layout, and no plain Shampoo, only KL-Shampoo/PSGD variants); Meta's
``distributed_shampoo`` (not on PyPI, and its distributed machinery is what owner
placement makes unnecessary); ``torch-optimizer`` (unmaintained since 2021).

How the library is driven (each matrix stepped alone, its state flat in ours, so
``state_dict()`` holds only tensors and plain scalars) is explained in :mod:`.matrix_library`,
home of the shared base :class:`~.matrix_library.MatrixLibraryOptimizer`. The classes stay
here: a checkpoint records an optimizer's qualified class name and checks it on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from .matrix_library import LIBRARY_REQUIREMENT, MatrixLibraryOptimizer
from .tail import is_matrix_role

__all__ = ["LIBRARY_REQUIREMENT", "SOAP", "Shampoo", "is_matrix_role"]

_GRAFT_TYPES = ("none", "sgd", "adagrad", "rmsprop", "sqrtn")  # LayerWiseGrafting order
_PRECONDITIONER_TYPES = ("all", "input", "output")  # PreConditionerType order


class SOAP(MatrixLibraryOptimizer):
    """SOAP (``pytorch_optimizer.SOAP``) on matrix roles, AdamW on the rest; no communication.

    Args:
        params: a module (its parameters in the Muon recipe's groups, :func:`~.groups.param_groups`),
            or parameters (by shape), or param groups (a group may override any default, and set
            ``"role"``).
        lr, betas, shampoo_beta, weight_decay, precondition_frequency, max_precondition_dim,
            correct_bias, normalize_gradient, eps: as ``pytorch_optimizer.SOAP`` (same
            defaults). ``shampoo_beta=None`` uses ``betas[1]``; factors of a dimension larger
            than ``max_precondition_dim`` are left out (identity). The library's
            ``merge_dims``/``precondition_1d``/``data_format`` only concern non-2D tensors,
            which never reach it here, so they are not exposed.
        adamw_lr: AdamW learning rate; ``None`` -> the group's ``lr`` (follows schedulers).
        adamw_betas, adamw_eps: AdamW betas and epsilon.
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` -> ``weight_decay``.
    """

    _library_name = "SOAP"
    _column_major_state = ("Q",)  # the eigenbases, from torch.linalg.qr / eigh
    _matrix_keys = ("lr", "betas", "shampoo_beta", "weight_decay", "precondition_frequency",
                    "max_precondition_dim", "correct_bias", "normalize_gradient", "eps")

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        weight_decay: float = 1e-2,
        precondition_frequency: int = 10,
        max_precondition_dim: int = 10000,
        correct_bias: bool = True,
        normalize_gradient: bool = False,
        eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        super().__init__(params, {
            "lr": lr, "betas": tuple(betas), "shampoo_beta": shampoo_beta, "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency, "max_precondition_dim": max_precondition_dim,
            "correct_bias": correct_bias, "normalize_gradient": normalize_gradient, "eps": eps,
            "adamw_lr": adamw_lr, "adamw_betas": tuple(adamw_betas), "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        })


class Shampoo(MatrixLibraryOptimizer):
    """Shampoo (``pytorch_optimizer.ScalableShampoo``) on matrix roles, AdamW on the rest.

    Blocked Kronecker-factored preconditioning with layer-wise grafting, as in Google's
    ``distributed_shampoo``; every matrix is whole on its owner, so no communication.
    The library's power iteration (``use_svd=False``) draws its start vector from a private
    generator seeded with the matrix's step count: the global RNG is left alone and a
    matrix's update does not depend on which other matrices its rank owns.

    Args:
        params: a module (its parameters in the Muon recipe's groups, :func:`~.groups.param_groups`),
            or parameters (by shape), or param groups (a group may override any default, and set
            ``"role"``).
        lr, betas, moving_average_for_momentum, weight_decay, decoupled_weight_decay,
            decoupled_learning_rate, nesterov, start_preconditioning_step,
            preconditioning_compute_steps, statistics_compute_steps, block_size,
            inverse_exponent_override, skip_preconditioning_rank_lt,
            no_preconditioning_for_layers_with_dim_gt, diagonal_eps, matrix_eps, use_svd:
            as ``pytorch_optimizer.ScalableShampoo`` (same defaults). ``betas[0]`` is the
            momentum, ``betas[1]`` the statistics' decay; before
            ``start_preconditioning_step`` the grafted update is used alone.
        shape_interpretation: the library's dimension merging. Default ``False`` here (the
            library's is ``True``): for a 2D matrix it can only merge both dimensions into
            one, which turns preconditioning off for any matrix with at most ``block_size``
            elements.
        graft_type: update-size reference: "sgd" (default), "adagrad", "rmsprop", "sqrtn",
            "none" (or the library's ``LayerWiseGrafting`` value).
        pre_conditioner_type: "all" (default), "input" or "output" (or ``PreConditionerType``).
        adamw_lr: AdamW learning rate; ``None`` -> the group's ``lr`` (follows schedulers).
        adamw_betas, adamw_eps: AdamW betas and epsilon.
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` -> ``weight_decay``.
    """

    _library_name = "ScalableShampoo"
    _uses_rng = True  # power iteration in the coupled-Newton inverse root
    _matrix_keys = ("lr", "betas", "moving_average_for_momentum", "weight_decay", "decoupled_weight_decay",
                    "decoupled_learning_rate", "nesterov", "start_preconditioning_step",
                    "preconditioning_compute_steps", "statistics_compute_steps", "block_size",
                    "inverse_exponent_override", "skip_preconditioning_rank_lt",
                    "no_preconditioning_for_layers_with_dim_gt", "shape_interpretation", "graft_type",
                    "pre_conditioner_type", "diagonal_eps", "matrix_eps", "use_svd")

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        moving_average_for_momentum: bool = False,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        decoupled_learning_rate: bool = True,
        nesterov: bool = True,
        start_preconditioning_step: int = 25,
        preconditioning_compute_steps: int = 1000,
        statistics_compute_steps: int = 1,
        block_size: int = 512,
        inverse_exponent_override: int = 0,
        skip_preconditioning_rank_lt: int = 1,
        no_preconditioning_for_layers_with_dim_gt: int = 8192,
        shape_interpretation: bool = False,
        graft_type: str | int = "sgd",
        pre_conditioner_type: str | int = "all",
        diagonal_eps: float = 1e-10,
        matrix_eps: float = 1e-6,
        use_svd: bool = False,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        super().__init__(params, {
            "lr": lr, "betas": tuple(betas), "moving_average_for_momentum": moving_average_for_momentum,
            "weight_decay": weight_decay, "decoupled_weight_decay": decoupled_weight_decay,
            "decoupled_learning_rate": decoupled_learning_rate, "nesterov": nesterov,
            "start_preconditioning_step": start_preconditioning_step,
            "preconditioning_compute_steps": preconditioning_compute_steps,
            "statistics_compute_steps": statistics_compute_steps, "block_size": block_size,
            "inverse_exponent_override": inverse_exponent_override,
            "skip_preconditioning_rank_lt": skip_preconditioning_rank_lt,
            "no_preconditioning_for_layers_with_dim_gt": no_preconditioning_for_layers_with_dim_gt,
            "shape_interpretation": shape_interpretation, "graft_type": graft_type,
            "pre_conditioner_type": pre_conditioner_type, "diagonal_eps": diagonal_eps,
            "matrix_eps": matrix_eps, "use_svd": use_svd,
            "adamw_lr": adamw_lr, "adamw_betas": tuple(adamw_betas), "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        })

    def _library_kwargs(self, group: dict[str, Any]) -> dict[str, Any]:
        """Enum names (CLI-friendly strings) -> the library's integer enum values."""
        kwargs = super()._library_kwargs(group)
        kwargs["graft_type"] = _enum_index("graft_type", kwargs["graft_type"], _GRAFT_TYPES)
        kwargs["pre_conditioner_type"] = _enum_index(
            "pre_conditioner_type", kwargs["pre_conditioner_type"], _PRECONDITIONER_TYPES)
        return kwargs


def _enum_index(what: str, value: str | int, names: tuple[str, ...]) -> int:
    """A name from ``names`` (case-insensitive) or its integer index -> the index."""
    if isinstance(value, str):
        if value.lower() not in names:
            raise ValueError(f"{what} must be one of {names}, got {value!r}")
        return names.index(value.lower())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= int(value) < len(names):
        raise ValueError(f"{what} must be one of {names} or an index below {len(names)}, got {value!r}")
    return int(value)
