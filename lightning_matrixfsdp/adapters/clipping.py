"""The Trainer's precision plugin, clipping by the global norm of owner-sharded gradients.

Lightning's plugins clip each rank's local gradients (``torch.nn.utils.clip_grad_norm_``),
which under owner sharding would give each rank a different norm. The strategy swaps its
plugin's class for a subclass with :class:`GlobalNormClip` in front (as ``FSDPStrategy``
gives its plugin a sharded clip), keeping the plugin's own state and everything else.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from torch import nn
from torch.optim import Optimizer

from lightning_matrixfsdp.adapters.shared import check_precision, clip_group
from lightning_matrixfsdp.adapters.pipeline import pipeline_of
from lightning_matrixfsdp.optim.norms import clip_grad_norm_, clip_grad_norm_pipeline_
from lightning_matrixfsdp.optim.routing import full_params

__all__ = ["GlobalNormClip", "install_clip_group", "with_global_norm_clip"]


class GlobalNormClip:
    """Precision-plugin mixin: clip by the global norm of owner-sharded gradients."""

    _mfsdp_clip_group: Any = None
    _mfsdp_clip_stats: Any = None  # the sharded model's CommStats: the all-reduce counts as "clip"

    _mfsdp_clip_pp: Any = None  # pipeline parallelism: the pipeline group (the norm is summed over it too)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self._mfsdp_clip_pp is not None:  # each stage's owners, then over the stages
            clip_grad_norm_pipeline_(full_params(optimizer), float(clip_val), group=self._mfsdp_clip_group,
                                     pp_group=self._mfsdp_clip_pp, stats=self._mfsdp_clip_stats)
            return
        # every rank's full list (DDP's order): the clip combines the norms exactly as torch does;
        # with tensor parallelism it finds the TP group from the list's TP fragments
        clip_grad_norm_(full_params(optimizer), float(clip_val), group=self._mfsdp_clip_group,
                        stats=self._mfsdp_clip_stats)


def with_global_norm_clip(plugin: Any, who: str) -> Any:
    """``plugin`` checked (``check_precision``) and clipping by the global norm (its class swapped once)."""
    if plugin is not None:
        check_precision(getattr(plugin, "precision", None), who)
        if not isinstance(plugin, GlobalNormClip):
            cls = type(plugin)
            plugin.__class__ = type(f"MatrixFSDP{cls.__name__}", (GlobalNormClip, cls), {})
    return plugin


def install_clip_group(plugin: Optional[Any], module: nn.Module) -> None:
    """Point the plugin's clip at the group and traffic stats of the sharded model in ``module``."""
    if isinstance(plugin, GlobalNormClip):
        session = pipeline_of(module)  # pipeline parallelism: a stage's groups, and the pipeline group
        group, stats = clip_group(session.run.stages[0] if session is not None else module)
        if stats is not None:  # a sharded model is there
            plugin._mfsdp_clip_group, plugin._mfsdp_clip_stats = group, stats
        plugin._mfsdp_clip_pp = session.run.pp_group if session is not None else None
