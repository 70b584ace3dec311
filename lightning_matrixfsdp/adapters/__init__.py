"""The Lightning side: everything of the package that imports Lightning (the demos aside).

The Trainer strategy (``trainer.py``), the Fabric strategy (``fabric.py``), the mixin and
helpers both share (``shared.py``), and one file per concern the Trainer strategy hands its
work to. The layers below (``checkpoint/``, ``optim/``, ``runtime/``) import nothing from here.
"""

from lightning_matrixfsdp.adapters.fabric import MatrixFSDPFabricStrategy, register_fabric
from lightning_matrixfsdp.adapters.from_checkpoint import DirectoryCheckpointIO, load_from_checkpoint
from lightning_matrixfsdp.adapters.pretrained import PretrainedWeights
from lightning_matrixfsdp.adapters.qk_clip import QKClip
from lightning_matrixfsdp.adapters.trainer import MatrixFSDPStrategy, register

__all__ = ["DirectoryCheckpointIO", "MatrixFSDPFabricStrategy", "MatrixFSDPStrategy", "PretrainedWeights", "QKClip", "load_from_checkpoint", "register",
           "register_fabric"]
