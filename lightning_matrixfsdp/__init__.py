"""Owner-sharded ZeRO-3 for PyTorch Lightning with exact matrix optimizers."""
__version__ = "0.1.0"
