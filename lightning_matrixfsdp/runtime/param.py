"""One parameter under owner placement: its resident tensor and its unsharded buffer.

The *resident* tensor is the user's own ``nn.Parameter`` object: full on the owner,
an empty placeholder elsewhere (``(0, *shape[1:])``, which keeps its rank so
``torch.optim.Muon`` accepts it).  The *unsharded* parameter is a second
``nn.Parameter`` created once and kept for the life of the model; only its storage
grows and shrinks.  Keeping the same storage object ("pinned") is what lets
tensors that autograd saved in forward see the data again in backward.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_matrixfsdp.runtime.placement import MatrixShard, RoleKind
from lightning_matrixfsdp.runtime.tags import tag_param
from lightning_matrixfsdp.runtime.tp.layout import as_dtensor, local_data
from lightning_matrixfsdp.runtime.tp.step_comm import local_fragment


def placeholder_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (0, *shape[1:]) if len(shape) >= 1 else (0,)


class ShardedParam:
    """Resident and unsharded states of one parameter (possibly registered in several places).

    ``pieces``: the parameter's entries in the plan: ``(shard,)`` for a whole parameter, one per
    block of experts for a split expert stack (``experts/split.py``). A block is a piece of its
    owner's segment like any whole parameter: the owner's resident tensor is its block
    ``[count, m, n]`` (an empty placeholder elsewhere), materialization fills each block's rows of
    the unsharded ``[E, m, n]`` from its owner, and the reduction delivers each block's rows of the
    gradient to its owner. ``shard`` is this rank's block (the first one where it holds none).
    """

    def __init__(
        self,
        shard: MatrixShard,
        resident: nn.Parameter,
        registrations: list[tuple[nn.Module, str]],
        rank: int,
        device: torch.device,
        compute_dtype: Optional[torch.dtype],
        reduce_dtype: Optional[torch.dtype],
        alone: bool = False,
        dtensor: Optional[tuple[Any, tuple, torch.Size, tuple[int, ...]]] = None,
        pieces: Sequence[MatrixShard] = (),
    ) -> None:
        self.pieces: tuple[MatrixShard, ...] = tuple(pieces) or (shard,)
        mine = [s for s in self.pieces if s.owner == rank]
        shard = mine[0] if mine else self.pieces[0]
        self.shard = shard
        #: tensor parallelism: (TP mesh, placements, global shape, global stride) of the DTensor the
        #: user's parameter was; the unsharded parameter is that DTensor again (over this rank's
        #: fragment), so the parallel styles of ``parallelize_module`` see what they placed
        self.dtensor = dtensor
        if dtensor is not None:  # the resident is this rank's fragment, a plain tensor
            resident = nn.Parameter(local_data(resident).detach(), requires_grad=resident.requires_grad)
        self.resident = resident
        self.registrations = registrations
        self.owned = shard.owner == rank
        self.device = device
        self.shape = torch.Size(shard.shape)
        self.orig_dtype = resident.dtype
        #: floating or complex: it can have a gradient (integer and bool parameters are always frozen)
        self.differentiable = resident.dtype.is_floating_point or resident.dtype.is_complex
        # param_dtype / reduce_dtype are floating dtypes: they apply to floating parameters only,
        # as in FSDP2 (an integer or complex parameter keeps its dtype)
        floating = resident.dtype.is_floating_point
        self.compute_dtype = (compute_dtype if floating else None) or resident.dtype
        self.reduce_dtype = (reduce_dtype if floating else None) or self.compute_dtype
        self._make_resident()
        tag_param(self.resident, shard, self.owned)
        #: A shard group of one rank with nothing to cast: the unsharded parameter shares the
        #: resident's storage, so materializing copies nothing and resharding frees nothing
        #: (the resident is whole here anyway). ``alloc`` re-points it if the resident's data
        #: was replaced since.
        self.aliases = alone and self.owned and self.compute_dtype == resident.dtype and dtensor is None
        # Created trainable (where the dtype allows) so the unit can hook it once; frozen-ness follows the resident.
        buffer = self.resident.data if self.aliases else torch.empty(self.shape, dtype=self.compute_dtype,
                                                                     device=device)
        # A plain alias of the same storage with its own version counter: writes
        # through it refill the buffer without tripping autograd's saved-tensor checks.
        self.data = buffer.data
        self.unsharded = nn.Parameter(self._wrap(buffer), requires_grad=self.differentiable)
        self._nbytes = self.data.numel() * self.data.element_size()
        if not self.aliases:
            self.data.untyped_storage().resize_(0)
        if dtensor is not None:
            self.to_resident()  # the fragment replaces the DTensor where the parameter is registered
        self.materialized = False

    def _wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor: ``local`` itself, or under TP the DTensor over it (same storage)."""
        return local if self.dtensor is None else as_dtensor(local, self.dtensor)

    # ------------------------------------------------------------------ resident state
    def _make_resident(self) -> None:
        p = self.resident
        shape = self.shard.block_shape if self.owned else placeholder_shape(tuple(self.shape))
        if self.owned and self.shard.experts is not None and not p.is_meta:  # a split stack: keep this block
            start, stop = self.shard.experts
            p.data = p.data[start:stop].to(self.device).clone()
            return
        if p.is_meta:
            # A meta tensor cannot take real data in place: register a new Parameter
            # (only the owner allocates the full tensor).
            self.resident = nn.Parameter(torch.empty(shape, dtype=p.dtype, device=self.device),
                                         requires_grad=p.requires_grad)
            self.to_resident()
        elif not self.owned or p.device != self.device:
            p.data = torch.empty(shape, dtype=p.dtype, device=self.device) if not self.owned else p.data.to(self.device)

    @property
    def is_matrix(self) -> bool:
        return self.shard.role is RoleKind.MATRIX

    @property
    def requires_grad(self) -> bool:
        return self.resident.requires_grad

    def source(self) -> Optional[torch.Tensor]:
        """What the owner contributes to materialization (the resident data)."""
        return self.resident.data if self.owned else None

    @property
    def split(self) -> bool:
        """An expert stack split into blocks on several owners."""
        return len(self.pieces) > 1

    def transfers(self) -> list[tuple[MatrixShard, Optional[torch.Tensor], torch.Tensor]]:
        """(entry, what this rank sends or None, where it lands in the unsharded buffer) of each
        piece: the whole parameter, or each expert block of a split stack."""
        if not self.split:
            return [(self.shard, self.source(), self.data)]
        return [(s, self.resident.data if s is self.shard and self.owned else None,
                 self.data[s.experts[0]:s.experts[1]]) for s in self.pieces]

    def grad_pieces(self, g: torch.Tensor) -> list[tuple[MatrixShard, torch.Tensor]]:
        """(entry, rows of the full local gradient ``g``) of each piece, as :meth:`transfers`."""
        if not self.split:
            return [(self.shard, g)]
        return [(s, g[s.experts[0]:s.experts[1]]) for s in self.pieces]

    # ------------------------------------------------------------------ unsharded state
    def alloc(self) -> None:
        """Give the pinned storage its bytes back (same storage object); when aliasing, make
        sure the unsharded parameter still shares the resident's data (a ``load_state_dict``
        with ``assign=True`` or ``p.data = ...`` replaces it)."""
        if self.aliases:
            r = self.resident.data
            # A device move (``model.cpu()``) is followed, as a plain module would; a dtype or shape
            # change is not: gradients are kept in the dtype the parameter had when it was sharded.
            if r.dtype != self.compute_dtype or r.shape != self.shape:
                raise RuntimeError(
                    f"parameter {self.shard.fqn!r} changed to {tuple(r.shape)} {r.dtype} after matrix_shard "
                    f"(it was {tuple(self.shape)} {self.compute_dtype}); change the dtype before sharding, or "
                    "pass param_dtype=")
            if self.unsharded.data_ptr() != r.data_ptr():
                self.unsharded.data = r
                self.data = self.unsharded.data
            return
        if not self.materialized:
            self.data.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        if not self.aliases:  # an alias shares the resident's bytes: nothing to give back
            self.data.untyped_storage().resize_(0)
        self.materialized = False

    def follow_requires_grad(self) -> None:
        """The unsharded parameter takes the resident's ``requires_grad`` (frozen-ness is the resident's)."""
        if self.unsharded.requires_grad != self.resident.requires_grad:
            self.unsharded.requires_grad_(self.resident.requires_grad)

    def to_unsharded(self) -> None:
        self.follow_requires_grad()
        for module, name in self.registrations:
            module._parameters[name] = self.unsharded

    def to_resident(self) -> None:
        for module, name in self.registrations:
            module._parameters[name] = self.resident

    # ------------------------------------------------------------------ gradients
    def local_grad(self) -> Optional[torch.Tensor]:
        """This rank's full gradient in the reduce dtype (None if autograd produced none)."""
        g = self.unsharded.grad
        if g is None:
            return None
        if self.dtensor is not None:
            g = local_fragment(g, self.dtensor[1])
        if g.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self.shard.fqn!r} got a {g.layout} gradient (e.g. from nn.Embedding(sparse=True)); "
                "matrix_fsdp reduces dense gradients to each parameter's owner: make the module produce dense "
                "gradients (nn.Embedding(..., sparse=False))")
        if g.dtype != self.reduce_dtype:
            g = g.to(self.reduce_dtype)
        return g.contiguous()

    def accumulate_grad(self, g: torch.Tensor) -> None:
        """Add the reduced full gradient to the resident parameter's ``.grad`` (owner only)."""
        g = g.to(self.orig_dtype)
        if self.split and g.untyped_storage().nbytes() > g.numel() * g.element_size():
            g = g.clone()  # a block's rows of a whole gradient: keep the block, not the whole
        if self.resident.grad is None:
            self.resident.grad = g
        else:
            self.resident.grad.add_(g)
