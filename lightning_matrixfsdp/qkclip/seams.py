"""Where QK-Clip reads the q and k an attention already computed, without changing its outputs.

* **Hugging Face attention** calls ``ALL_ATTENTION_FUNCTIONS.get_interface(implementation,
  eager_attention_forward)(self, query, key, value, attention_mask, scaling=..., ...)`` after
  the rotary embedding. While a clip is attached, ``AttentionInterface.get_interface`` hands out
  the same function wrapped: for a module a clip watches, in training mode, the wrapper passes
  the post-rotary ``query`` / ``key``, the mask the softmax sees and the softmax scale to the
  clip, then calls the function with its arguments untouched; every other module goes straight
  through. The class attribute is restored when the last clip detaches.
* **A fused ``qkv`` projection** (the demos' GPT): a forward hook on the projection reads its
  output (q and k are its first two thirds; no rotary embedding follows).

Both read detached tensors under ``no_grad``; nothing is written back.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.qkclip.layouts import QKClipError
from lightning_matrixfsdp.qkclip.logits import LogitMask

__all__ = ["hf_logit_mask", "watch_hf_attention", "watch_qkv_output"]

#: the record callback: (query [B, H, T, d], key [B, KV, S, d], mask, softmax scale or None)
Record = Callable[[torch.Tensor, torch.Tensor, LogitMask, Optional[float]], None]

_WATCHED: "weakref.WeakKeyDictionary[nn.Module, Record]" = weakref.WeakKeyDictionary()
_PATCH: dict[str, Any] = {"users": 0, "original": None, "wrapped": {}}


class _Handle:
    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Optional[Callable[[], None]] = remove

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None


def _family(implementation: Optional[str]) -> str:
    name = (implementation or "eager").split("|")[-1]
    if "flash" in name:
        return "flash"
    if name in ("eager", "sdpa"):
        return name
    return "other"


def _segments(kwargs: dict, b: int, s: int, device: torch.device) -> Optional[torch.Tensor]:
    """Packed sequences under the flash implementations: their boundaries as segment ids ``[1, S]``,
    from ``cu_seq_lens_k`` or (batch 1) from ``position_ids`` restarting at 0, as transformers packs."""
    cu = kwargs.get("cu_seq_lens_k", kwargs.get("cu_seq_lens_q"))
    if cu is not None:
        return torch.bucketize(torch.arange(s, device=device), cu[1:].to(device), right=True).unsqueeze(0)
    pos = kwargs.get("position_ids")
    if pos is not None and b == 1 and pos.shape[-1] == s:
        return (pos.reshape(1, -1) == 0).cumsum(-1)
    return None


def hf_logit_mask(implementation: Optional[str], module: nn.Module, q: torch.Tensor, k: torch.Tensor,
                  attention_mask: Any, kwargs: dict) -> LogitMask:
    """The (query, key) pairs a Hugging Face attention function's softmax sees, from its arguments."""
    family = _family(implementation)
    t, s = q.shape[2], k.shape[2]
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal) and t > 1
    window = kwargs.get("sliding_window") if family == "flash" else None  # eager/sdpa: inside the mask
    if attention_mask is None:
        segments = _segments(kwargs, q.shape[0], s, q.device) if family == "flash" else None
        return LogitMask(None, causal, window, segments)
    if not isinstance(attention_mask, torch.Tensor) or family == "other":
        raise QKClipError(
            f"QK-Clip cannot read the mask of attention implementation {implementation!r} "
            f"({type(attention_mask).__name__}); train with attn_implementation='sdpa' or 'eager' "
            "(or a flash implementation) while QK-Clip is on")
    if attention_mask.dim() == 4:
        allowed = attention_mask if attention_mask.dtype == torch.bool else \
            attention_mask > torch.finfo(attention_mask.dtype).min / 2
        return LogitMask(allowed)
    if attention_mask.dim() == 2:  # flash: padding mask [B, S]; queries are its last T columns
        valid = attention_mask.bool()
        allowed = valid[:, -t:].reshape(-1, 1, t, 1) & valid.reshape(-1, 1, 1, s)
        return LogitMask(allowed, causal, window)
    raise QKClipError(f"QK-Clip cannot read an attention mask of shape {tuple(attention_mask.shape)}")


def _wrap(implementation: Optional[str], fn: Callable) -> Callable:
    key = (implementation, fn)
    wrapped = _PATCH["wrapped"].get(key)
    if wrapped is not None:
        return wrapped

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        record = _WATCHED.get(module)
        if record is not None and module.training:
            mask = hf_logit_mask(implementation, module, query, key, attention_mask, kwargs)
            record(query, key, mask, kwargs.get("scaling"))
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__wrapped__ = fn  # type: ignore[attr-defined]
    _PATCH["wrapped"][key] = attention
    return attention


def _install() -> None:
    from transformers.modeling_utils import AttentionInterface

    if not hasattr(AttentionInterface, "get_interface"):
        import transformers

        raise QKClipError(f"QK-Clip reads Hugging Face attention through AttentionInterface.get_interface, which "
                          f"transformers {transformers.__version__} lacks; upgrade transformers (5.x has it)")
    if _PATCH["users"] == 0:
        original = AttentionInterface.get_interface

        def get_interface(self: Any, attn_implementation: Optional[str], default: Callable) -> Callable:
            return _wrap(attn_implementation, original(self, attn_implementation, default))

        _PATCH["original"] = original
        AttentionInterface.get_interface = get_interface  # type: ignore[method-assign]
    _PATCH["users"] += 1


def _uninstall() -> None:
    from transformers.modeling_utils import AttentionInterface

    _PATCH["users"] -= 1
    if _PATCH["users"] == 0:
        AttentionInterface.get_interface = _PATCH["original"]  # type: ignore[method-assign]
        _PATCH["original"] = None
        _PATCH["wrapped"].clear()


def watch_hf_attention(module: nn.Module, record: Record) -> _Handle:
    """Call ``record`` with the logits' inputs of every training-mode forward of ``module`` (a
    Hugging Face attention module); ``remove()`` the handle to stop."""
    if module in _WATCHED:
        raise QKClipError(f"QK-Clip: {type(module).__name__} is already watched by another QK-Clip; "
                          "remove that one first (one clip per model)")
    _install()
    _WATCHED[module] = record

    def remove() -> None:
        _WATCHED.pop(module, None)
        _uninstall()

    return _Handle(remove)


def watch_qkv_output(module: nn.Module, proj: nn.Module, heads: int, record: Record) -> _Handle:
    """``record`` the q and k of a fused ``[q, k, v]`` projection's output ``[B, T, 3C]`` (causal
    heads of ``C / heads``) at every training-mode forward of ``module``."""

    def hook(_: nn.Module, args: Any, out: torch.Tensor) -> None:
        if not module.training:
            return
        if not type(out) is torch.Tensor:
            raise QKClipError(f"QK-Clip reads the fused projection's output as a plain tensor, got "
                              f"{type(out).__name__}; gather it (e.g. output_layouts=Replicate()) before the heads form")
        b, t, three_c = out.shape
        c = three_c // 3
        q = out[..., :c].reshape(b, t, heads, c // heads).transpose(1, 2)
        k = out[..., c:2 * c].reshape(b, t, heads, c // heads).transpose(1, 2)
        record(q, k, LogitMask(causal=t > 1), None)

    return _Handle(proj.register_forward_hook(hook).remove)
