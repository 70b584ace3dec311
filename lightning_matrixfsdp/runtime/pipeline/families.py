"""Pipeline stages of the model families we know, built without editing the user's model.

A family says where a model's embeddings, repeated blocks and norm + head live, and how one
stage runs: the first stage takes token ids, the others the previous stage's hidden states,
and the last returns logits. A :class:`StageModule` registers the modules a stage keeps under
their global names (``model.layers.8.mlp.up_proj.weight`` stays that), so its parameter names
are the whole model's and checkpoints need no renaming. The modules are the model's own
objects: nothing is copied. Known families: the demos' GPT, litgpt's GPT, and the Hugging
Face decoder causal LMs whose head is a plain linear layer on the final norm (Llama, Mistral,
Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.pipeline.split import StageSpan

__all__ = ["FAMILIES", "Family", "StageInfo", "StageModule", "family_of"]

#: Hugging Face causal LMs whose forward is embeddings -> decoder layers -> norm -> lm_head, nothing else
HF_PLAIN_HEADS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True, eq=False)
class StageInfo:
    """What a stage module knows besides its modules (one attribute, ``pipeline``, so that no name
    of the user's model is shadowed)."""

    span: StageSpan
    family: str
    run: Callable[["StageModule", torch.Tensor], torch.Tensor]
    hidden_size: int
    vocab_size: int
    #: what the family's forward reads beyond the modules (names, the config)
    extras: dict[str, Any]


class StageModule(nn.Module):
    """One stage of a pipelined model: the modules it keeps, under their global names, and the
    family's forward for this stage (token ids or hidden states in; hidden states or logits out)."""

    def __init__(self, model: nn.Module, span: StageSpan, keep: list[str], family: "Family") -> None:
        super().__init__()
        for fqn in keep:
            _attach(self, fqn, model.get_submodule(fqn))
        for name, tensor in family.buffers(model).items():  # tables the stage's forward reads (a rope cache)
            self.register_buffer(name, tensor, persistent=False)
        hidden, vocab = family.widths(model)
        self.pipeline = StageInfo(span, family.name, family.run, hidden, vocab, family.extras(model))

    def stage_blocks(self) -> list[nn.Module]:
        """The stage's blocks, in model order."""
        return [self.get_submodule(n) for n in self.pipeline.span.blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pipeline.run(self, x)

    def get_output_embeddings(self) -> Optional[nn.Module]:
        """The head on the last stage (what the Muon recipe asks to put on AdamW), else None."""
        return self.get_submodule(self.pipeline.extras["head"]) if self.pipeline.span.last else None

    def output_shape(self, tokens: torch.Size) -> tuple[int, ...]:
        """The shape of this stage's output for token ids of shape ``tokens``."""
        info = self.pipeline
        return (*tokens, info.vocab_size if info.span.last else info.hidden_size)

    def input_shape(self, tokens: torch.Size) -> tuple[int, ...]:
        """The shape of this stage's input for token ids of shape ``tokens``."""
        info = self.pipeline
        return tuple(tokens) if info.span.first else (*tokens, info.hidden_size)


def _attach(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Register ``module`` at the dotted path ``fqn`` under ``root``, with empty containers between."""
    *parents, leaf = fqn.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    node.add_module(leaf, module)


@dataclass(frozen=True)
class Family:
    """Where a family's pieces live and how a stage runs."""

    name: str
    matches: Callable[[nn.Module], bool]
    #: module names of the repeated blocks, in model order
    blocks: Callable[[nn.Module], list[str]]
    #: module names on the first stage besides blocks, on the last, on every stage
    pre: tuple[str, ...]
    post: tuple[str, ...]
    shared: tuple[str, ...]
    #: the stage's forward: (stage module, input) -> output
    run: Callable[[StageModule, torch.Tensor], torch.Tensor]
    #: (hidden size, vocabulary size) of the whole model
    widths: Callable[[nn.Module], tuple[int, int]]
    #: what the stage's forward needs beyond its modules (names, config), read once from the model
    extras: Callable[[nn.Module], dict[str, Any]]
    #: a reason to refuse this model though the family matches, or None
    refuse: Callable[[nn.Module], Optional[str]] = lambda model: None
    #: tensors of the model outside its modules that every stage's forward reads (non-persistent buffers)
    buffers: Callable[[nn.Module], dict[str, torch.Tensor]] = lambda model: {}

    def keep(self, model: nn.Module, span: StageSpan) -> list[str]:
        """The module names a stage keeps."""
        present = [n for n in self.shared if _has(model, n)]
        return ([n for n in self.pre if _has(model, n)] if span.first else []) + present + list(span.blocks) \
            + ([n for n in self.post if _has(model, n)] if span.last else [])


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


# ---------------------------------------------------------------- the demos' GPT
def _gpt_run(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    if stage.pipeline.span.first:
        t = x.size(1)
        x = stage.drop(stage.tok_emb(x) + stage.pos_emb(torch.arange(t, device=x.device)))
    for block in stage.stage_blocks():
        x = block(x)
    if stage.pipeline.span.last:
        x = stage.head(stage.ln_f(x))
    return x


def _gpt_matches(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("tok_emb", "pos_emb", "blocks", "ln_f", "head"))


DEMO_GPT = Family("demos GPT", _gpt_matches, lambda m: [f"blocks.{i}" for i in range(len(m.blocks))],
                  pre=("tok_emb", "pos_emb"), post=("ln_f", "head"), shared=("drop",), run=_gpt_run,
                  widths=lambda m: (m.tok_emb.embedding_dim, m.head.out_features), extras=lambda m: {"head": "head"})


# ---------------------------------------------------------------- Hugging Face decoder causal LMs
def _hf_matches(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (type(model).__name__.endswith("ForCausalLM") and hasattr(model, "lm_head")
            and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")))


def _hf_refuse(model: nn.Module) -> Optional[str]:
    name = type(model).__name__
    if name not in HF_PLAIN_HEADS:
        return (f"{name}'s forward may do more than norm -> lm_head after its layers (logit scaling, soft-capping); "
                f"pipelined Hugging Face models are {', '.join(HF_PLAIN_HEADS)}")
    config = model.config
    if getattr(config, "output_router_logits", False):
        # the load-balancing loss is a product of means over every layer's router outputs, which
        # live on every stage; the last stage's loss would silently train without it
        coef = getattr(config, "router_aux_loss_coef", None)
        return ("config.output_router_logits=True asks for the router's load-balancing loss (router_aux_loss_coef="
                f"{coef}), which needs every layer's router logits, spread over all stages, on the last stage: "
                "pipeline parallelism cannot add it yet. Set output_router_logits=False in the model's config "
                "to train without it under pipeline parallelism, or keep it with pipeline_parallel_size=1 "
                "(expert parallelism keeps it)")
    return None


def _hf_extras(model: nn.Module) -> dict[str, Any]:
    config = model.config
    # as each family's decoder does: a layer that names its attention type gets that mask (Qwen3),
    # the others the sliding-window mask where the config sets a window (Mixtral, Qwen3-MoE), else causal
    types = {getattr(layer, "attention_type", None) for layer in model.model.layers}
    default = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return {"config": config, "mask_types": types - {None} | {default}, "default_mask": default, "head": "lm_head"}


def _hf_masks(stage: StageModule, h: torch.Tensor, cache_position: torch.Tensor,
              position_ids: torch.Tensor) -> dict[str, Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = dict(config=stage.pipeline.extras["config"], inputs_embeds=h, attention_mask=None, cache_position=cache_position,
              past_key_values=None, position_ids=position_ids)
    make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return {t: make[t](**kw) for t in stage.pipeline.extras["mask_types"]}


def _hf_run(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    inner = stage.model
    h = inner.embed_tokens(x) if stage.pipeline.span.first else x
    cache_position = torch.arange(h.shape[1], device=h.device)
    position_ids = cache_position.unsqueeze(0)
    masks = _hf_masks(stage, h, cache_position, position_ids)
    position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
    for layer in stage.stage_blocks():
        h = layer(h, attention_mask=masks[getattr(layer, "attention_type", None) or stage.pipeline.extras["default_mask"]],
                  position_embeddings=position_embeddings, position_ids=position_ids, past_key_values=None,
                  use_cache=False, cache_position=cache_position)
        h = h[0] if isinstance(h, tuple) else h
    if stage.pipeline.span.last:
        h = stage.lm_head(inner.norm(h))
    return h


HF_CAUSAL_LM = Family("Hugging Face causal LM", _hf_matches,
                      lambda m: [f"model.layers.{i}" for i in range(m.config.num_hidden_layers)],
                      pre=("model.embed_tokens",), post=("model.norm", "lm_head"), shared=("model.rotary_emb",),
                      run=_hf_run, widths=lambda m: (m.config.hidden_size, m.lm_head.out_features),
                      extras=_hf_extras, refuse=_hf_refuse)

# ---------------------------------------------------------------- litgpt's GPT
def _litgpt_matches(model: nn.Module) -> bool:
    t = getattr(model, "transformer", None)
    return hasattr(model, "lm_head") and hasattr(model, "config") and all(
        hasattr(t, a) for a in ("wte", "h", "ln_f")) and hasattr(model, "cos")


def _litgpt_run(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    config = stage.pipeline.extras["config"]
    t = x.size(1)
    cos, sin = stage.pipeline_cos[:t].unsqueeze(0), stage.pipeline_sin[:t].unsqueeze(0)
    if stage.pipeline.span.first:
        x = stage.transformer.wte(x)
        if config.scale_embeddings:
            x = x * torch.tensor(config.n_embd ** 0.5, dtype=x.dtype)
    for name, block in zip(stage.pipeline.span.blocks, stage.stage_blocks()):
        if config.rope_indices is not None:  # as litgpt's forward: this block's share of the rope table
            index = config.rope_indices[int(name.rsplit(".", 1)[1])]
            x = block(x, cos[..., index], sin[..., index], None, None, None)
        else:
            x = block(x, cos, sin, None, None, None)
    if stage.pipeline.span.last:
        x = stage.lm_head(stage.transformer.ln_f(x))
        if config.final_logit_softcapping is not None:
            from litgpt.model import do_softcapping

            x = do_softcapping(x, thresh=config.final_logit_softcapping)
    return x


LITGPT = Family("litgpt GPT", _litgpt_matches, lambda m: [f"transformer.h.{i}" for i in range(len(m.transformer.h))],
                pre=("transformer.wte",), post=("transformer.ln_f", "lm_head"), shared=(), run=_litgpt_run,
                widths=lambda m: (m.config.n_embd, m.lm_head.out_features),
                extras=lambda m: {"config": m.config, "head": "lm_head"},
                buffers=lambda m: {"pipeline_cos": m.cos, "pipeline_sin": m.sin})

#: the families, tried in this order
FAMILIES: tuple[Family, ...] = (HF_CAUSAL_LM, LITGPT, DEMO_GPT)


def family_of(model: nn.Module, name: Optional[str] = None) -> Family:
    """The family of ``model`` (``name``: one of ``FAMILIES`` by name, else found by structure);
    refuses a model no family knows, or one its family cannot pipeline, naming why."""
    found = [f for f in FAMILIES if (f.name == name if name else f.matches(model))]
    if not found:
        known = ", ".join(f.name for f in FAMILIES)
        raise MatrixShardError(f"pipeline parallelism does not know how to split {type(model).__name__}"
                               + (f" as family {name!r}" if name else "") + f"; known families: {known}")
    family = found[0]
    why = family.refuse(model)
    if why:
        raise MatrixShardError(f"cannot pipeline {type(model).__name__}: {why}")
    return family
