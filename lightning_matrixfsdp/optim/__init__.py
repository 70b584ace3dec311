"""Optimizers for owner-sharded models: Muon (+AdamW tail), routing of any torch optimizer."""
from lightning_matrixfsdp.optim.muon import Muon, uses_muon
from lightning_matrixfsdp.optim.routing import clip_grad_norm_, is_owned, route_optimizer

__all__ = ["Muon", "clip_grad_norm_", "is_owned", "route_optimizer", "uses_muon"]
