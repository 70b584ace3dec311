"""Optimizers for owner-sharded models: Muon (+AdamW tail), routing of any torch optimizer."""
from lightning_matrixfsdp.optim.muon import Muon, uses_muon
from lightning_matrixfsdp.optim.norms import clip_grad_norm_, grad_norm
from lightning_matrixfsdp.optim.routing import is_owned, route_optimizer

__all__ = ["Muon", "clip_grad_norm_", "grad_norm", "is_owned", "route_optimizer", "uses_muon"]
