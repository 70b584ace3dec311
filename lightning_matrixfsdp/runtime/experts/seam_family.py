"""The shape of an expert forward seam: one :class:`SeamFamily` per model family, and the
expert-parallel forward :func:`install` puts on a module (an :class:`InstalledSeam`).

A family says three things about its experts modules: whether a module is one of them
(:meth:`SeamFamily.matches`), the module's own computation on this rank's experts, rows sorted
by expert (:meth:`SeamFamily.local`), and the forward that replaces the module's own under
expert parallelism (:meth:`SeamFamily.forward`, with the module's argument names, since
models call it by keyword). The families themselves and their one table live in
``experts/seams.py`` (Hugging Face top-k, torchtitan-style grouped) and ``experts/gptoss.py``.

The installed forward is one visible object on the instance (``module.forward``, also kept
under a mark for the uneven-evaluation join), and :func:`uninstall` removes it again. Nothing
here communicates itself: the dispatch it is given does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["InstalledSeam", "SeamFamily", "arg_names", "counts_tensor", "eager_local", "expert_ids", "install",
           "installed", "own_forward", "set_announce", "stacked", "uninstall"]

_INSTALLED = "_mfsdp_ep_seam"  # the mark of an installed seam (runtime/join.py finds the seams by it)
_ANNOUNCE = "_mfsdp_ep_announce"  # the join's callback, told before each token exchange

#: ``local(x [N, H] sorted by expert, counts [E_local]) -> [N, H]``: the experts' computation on this rank
Local = Callable[[torch.Tensor, Any], torch.Tensor]


class SeamFamily:
    """One model family's experts modules. Subclasses set :attr:`name` and implement the three methods."""

    name: str = ""

    def matches(self, module: nn.Module, args: tuple[str, ...]) -> bool:
        """Whether ``module`` (whose class's forward takes ``args`` after ``self``) is of this family."""
        raise NotImplementedError

    def local(self, module: nn.Module, fused: Optional[Callable[..., torch.Tensor]]) -> Local:
        """The module's computation on this rank's experts (``fused``: an optional faster one, by layout)."""
        raise NotImplementedError

    def forward(self, seam: "InstalledSeam", *args: Any, **kwargs: Any) -> torch.Tensor:
        """The expert-parallel forward, taking the module's own arguments: ``seam.dispatch(hidden,
        top_k_index [T, k], top_k_weights [T, k])`` with the routing in that form."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class InstalledSeam:
    """The forward :func:`install` sets on an experts module: its family's forward, with the dispatch."""

    def __init__(self, family: SeamFamily, module: nn.Module, num_experts: int, local: Local,
                 exchange: Callable[..., torch.Tensor], group: Any) -> None:
        self.family, self.module, self.num_experts = family, module, num_experts
        self.local, self.exchange, self.group = local, exchange, group

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.family.forward(self, *args, **kwargs)

    def dispatch(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Send each row to its experts' ranks and back, telling the join's callback (if set) first."""
        announce = self.module.__dict__.get(_ANNOUNCE)
        if announce is not None:
            announce(hidden)
        return self.exchange(hidden, index, weights, self.num_experts, self.local, self.group)

    def without_tokens(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """The exchange with no row of this rank's own (collective; the callback is not told)."""
        self.exchange(torch.zeros(0, hidden_size, dtype=dtype, device=device),
                      torch.zeros(0, 1, dtype=torch.long, device=device),
                      torch.zeros(0, 1, dtype=dtype, device=device), self.num_experts, self.local, self.group)

    def __deepcopy__(self, memo: dict) -> "InstalledSeam":
        # as the function it stands for: a deep copy of the module shares it (it holds process groups)
        return self

    def __repr__(self) -> str:
        return f"InstalledSeam({self.family.name}, {type(self.module).__name__}, num_experts={self.num_experts})"


def install(family: SeamFamily, module: nn.Module, num_experts: int, exchange: Callable[..., torch.Tensor],
            group: Any, fused: Optional[Callable[..., torch.Tensor]] = None) -> InstalledSeam:
    """Replace ``module``'s forward (an instance attribute; the class stays) by ``family``'s
    expert-parallel one over ``exchange`` (``expert_parallel_forward``); returns it."""
    seam = InstalledSeam(family, module, num_experts, family.local(module, fused), exchange, group)
    module.forward = seam  # type: ignore[method-assign]
    object.__setattr__(module, _INSTALLED, seam)
    return seam


def installed(module: nn.Module) -> Optional[InstalledSeam]:
    """The seam :func:`install` put on ``module``, or None."""
    return module.__dict__.get(_INSTALLED)


def uninstall(module: nn.Module) -> None:
    """Give ``module`` its class's forward back (nothing if no seam is installed)."""
    seam = module.__dict__.pop(_INSTALLED, None)
    if seam is not None and module.__dict__.get("forward") is seam:
        del module.__dict__["forward"]


def set_announce(module: nn.Module, announce: Optional[Callable[[torch.Tensor], None]]) -> None:
    """``announce(hidden)`` runs before each token exchange of ``module`` (None: nothing runs)."""
    if announce is None:
        module.__dict__.pop(_ANNOUNCE, None)
    else:
        object.__setattr__(module, _ANNOUNCE, announce)


def arg_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The positional argument names of an unbound ``forward`` after ``self`` (() if unreadable)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def stacked(module: nn.Module) -> bool:
    """Whether ``module`` registers at least one 3-D parameter (experts stacked ``[E, ...]``)."""
    return any(p is not None and p.ndim == 3 for p in module._parameters.values())


def counts_tensor(counts: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(counts, dtype=torch.int64, device=device)


def expert_ids(counts: Any, device: torch.device) -> torch.Tensor:
    """Row ``i`` of an expert-major batch -> its expert's index (``counts[e]`` rows of expert ``e``)."""
    c = counts_tensor(counts, device)
    return torch.repeat_interleave(torch.arange(c.numel(), device=device), c)


def eager_local(own: Callable[..., torch.Tensor], module: nn.Module, x: torch.Tensor, counts: Any) -> torch.Tensor:
    """``own(module, hidden, index, weights)`` (a top-k forward) with every row sent to one local
    expert with weight 1: the module's own per-expert computation on expert-major rows."""
    ids = expert_ids(counts, x.device)
    return own(module, x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device))


def own_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    """The class's forward, under transformers' implementation switch (its eager loop)."""
    own = type(module).forward
    return getattr(own, "__wrapped__", own)
