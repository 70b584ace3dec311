"""QK-Clip (Kimi K2's MuonClip): each attention head's query and key weights rescaled after the
optimizer step when the head's largest pre-softmax logit of the step exceeded ``tau``.

``QKClipper`` (clip.py) is the core any loop can use; the Lightning callback ``QKClip`` is in
``adapters/qk_clip.py``. docs/qk-clip.md describes the rule and its cost.
"""
from lightning_matrixfsdp.qkclip.clip import QKClipper
from lightning_matrixfsdp.qkclip.layouts import QKClipError

__all__ = ["QKClipError", "QKClipper"]
