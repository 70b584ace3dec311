"""Tensor parallelism: a parameter's split over the TP group, the TP half of a plan, and the optimizer step's and the checkpoints' TP traffic."""
