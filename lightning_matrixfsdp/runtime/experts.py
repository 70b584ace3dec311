"""Expert stacks: which 3-D parameters are E independent matrices, declared, never guessed.

A mixture-of-experts layer often stores its experts as one parameter ``[E, m, n]``: E
matrices of shape ``(m, n)`` side by side. Such a *stack* is a matrix role: the optimizer
steps it as ``p.shape[0]`` independent matrices (whatever ``p.shape[0]`` is: under expert
parallelism a rank holds ``[E / EP, m, n]`` with the same declaration), and each matrix as
its row blocks ``blocks`` (a fused ``gate_up_proj [E, 2I, H]`` is the two ``(I, H)`` matrices
``gate`` and ``up``; a plain stack is one block of ``m`` rows).

Which parameters are stacks comes from a declaration, not from ``ndim`` (a convolution
kernel is 4-D too):

- automatically, for the expert modules of Hugging Face transformers (the classes its
  ``use_experts_implementation`` decorator marks, in the ``F.linear`` layout ``[E, out, in]``
  with gate and up as contiguous halves: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...)
  and for torchtitan-style ``GroupedExperts`` (3-D ``w1``/``w2``/``w3``);
- by the ``expert_stacks`` option for a user's own module (:func:`check_expert_stacks`
  lists its forms), which overrides the automatic declaration of a parameter.

Pure: no communication; ``shard.collect`` asks :func:`declared_stacks` once per model.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from torch import nn

__all__ = ["ExpertStack", "ExpertStacksOption", "auto_stacks", "check_expert_stacks", "declared_stacks",
           "expert_biases"]


class ExpertStackError(ValueError):
    """A stack declaration that does not fit its parameter (a ``MatrixShardError`` in spirit;
    defined here so this module stays below ``options.py``)."""


@dataclass(frozen=True)
class ExpertStack:
    """A parameter ``[E, m, n]`` holding ``num_experts`` matrices, each made of row blocks.

    ``blocks``: the row-block sizes of ONE expert matrix along its first matrix dimension
    (``sum(blocks) == m``): ``(I, I)`` for a fused gate/up projection, ``(m,)`` for a plain
    stack. Each block is orthogonalized (and priced) as a matrix of its own.
    """

    num_experts: int
    blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        blocks = tuple(self.blocks) if isinstance(self.blocks, (list, tuple)) else self.blocks
        object.__setattr__(self, "blocks", blocks)
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ExpertStackError(f"ExpertStack.num_experts must be a positive int, got {self.num_experts!r}")
        if (not isinstance(blocks, tuple) or not blocks
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks)):
            raise ExpertStackError(f"ExpertStack.blocks must be a non-empty tuple of positive ints, got {blocks!r}")

    @property
    def rows(self) -> int:
        """Rows of one expert matrix (``m``)."""
        return sum(self.blocks)

    def matrices(self, cols: int) -> list[tuple[int, int]]:
        """The shape of each matrix one expert is stepped as (one per block)."""
        return [(b, int(cols)) for b in self.blocks]

    def check(self, fqn: str, shape: tuple[int, ...]) -> None:
        """Refuse a declaration that does not fit the whole parameter ``shape``."""
        if len(shape) != 3:
            raise ExpertStackError(f"parameter {fqn!r} of shape {tuple(shape)} is declared an expert stack, "
                                   "which needs three dimensions [experts, rows, cols]")
        if int(shape[0]) != self.num_experts or int(shape[1]) != self.rows:
            raise ExpertStackError(
                f"parameter {fqn!r} of shape {tuple(shape)} does not fit its expert stack declaration "
                f"({self.num_experts} experts of {self.rows} rows in blocks {self.blocks})")

    def to_dict(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "blocks": list(self.blocks)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ExpertStack":
        return ExpertStack(int(d["num_experts"]), tuple(int(b) for b in d["blocks"]))

    def describe(self) -> str:
        split = "" if len(self.blocks) == 1 else f", each as {len(self.blocks)} blocks {self.blocks}"
        return f"{self.num_experts} experts{split}"


#: The ``expert_stacks`` option once checked: None, a tuple of (fqn pattern, blocks) pairs
#: (blocks: None for a plain stack, an int k for k equal row blocks, or a tuple of row sizes),
#: or a callable ``(fqn, param) -> ExpertStack | bool | None``.
ExpertStacksOption = Union[None, tuple, Callable[[str, nn.Parameter], Any]]

_FORMS = ("None, an fqn glob pattern or a list of them (each matching 3-D parameter a plain stack), a dict "
          "{pattern: blocks} (blocks: an int k for k equal row blocks, e.g. 2 for a fused gate/up, or a list of "
          "row sizes), or a callable (fqn, param) -> ExpertStack | bool | None")


def _check_blocks(value: Any, name: str, pattern: str) -> Union[None, int, tuple[int, ...]]:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in value)):
        return tuple(int(b) for b in value)
    raise ExpertStackError(f"{name}=...{{{pattern!r}: {value!r}}}: the blocks of pattern {pattern!r} are {value!r} ({type(value).__name__}); "
                           "expected None, a positive int (that many equal row blocks) or a list of positive "
                           "row sizes")


def _check_arity(fn: Callable[..., Any], name: str) -> None:
    """Refuse a callable that cannot be called as ``fn(fqn, param)`` now, not at the first use."""
    try:
        inspect.signature(fn).bind("fqn", None)
    except TypeError:
        raise ExpertStackError(f"{name}={fn!r} cannot be called as {name}(fqn, param); expected {_FORMS}") from None
    except ValueError:  # no signature to read (some builtins): left to the first call
        pass


def check_expert_stacks(value: Any, name: str = "expert_stacks") -> ExpertStacksOption:
    """Normalize the ``expert_stacks`` option (see :data:`ExpertStacksOption`), or refuse it
    naming the option. Raises ``ExpertStackError`` (a ``ValueError``)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [tuple(v) if isinstance(v, (list, tuple)) and len(v) == 2 else (v, None) for v in value]
    elif callable(value) and not isinstance(value, (type, nn.Module)):
        _check_arity(value, name)
        return value
    else:
        raise ExpertStackError(f"{name}={value!r} ({type(value).__name__}) is not accepted; expected {_FORMS}")
    out = []
    for pattern, blocks in items:
        if not isinstance(pattern, str) or not pattern:
            raise ExpertStackError(f"{name}={value!r}: pattern {pattern!r} ({type(pattern).__name__}) is not a non-empty "
                                   f"fqn glob string; expected {_FORMS}")
        out.append((pattern, _check_blocks(blocks, name, pattern)))
    return tuple(sorted(out, key=lambda pb: pb[0]))


def _stack_from_blocks(fqn: str, p: nn.Parameter, blocks: Union[None, int, tuple[int, ...]]) -> ExpertStack:
    if p.ndim != 3:
        raise ExpertStackError(f"expert_stacks declares {fqn!r} a stack, but it has shape {tuple(p.shape)}; a stack "
                               "has three dimensions [experts, rows, cols]")
    rows = int(p.shape[1])
    if blocks is None:
        sizes: tuple[int, ...] = (rows,)
    elif isinstance(blocks, int):
        if rows % blocks:
            raise ExpertStackError(f"expert_stacks splits {fqn!r} (rows {rows}) into {blocks} equal blocks, "
                                   "which do not divide it")
        sizes = (rows // blocks,) * blocks
    else:
        sizes = tuple(blocks)
    stack = ExpertStack(int(p.shape[0]), sizes)
    stack.check(fqn, tuple(p.shape))
    return stack


# ---------------------------------------------------------------------- automatic
def _hf_stacks(mod: nn.Module) -> Optional[dict[str, tuple[ExpertStack, str]]]:
    """A Hugging Face experts module in the ``F.linear`` layout, or None."""
    if not hasattr(mod, "has_gate") or getattr(mod, "is_transposed", True):
        return None  # not marked by use_experts_implementation, or stored (in, out) (GPT-OSS: not served)
    down = mod._parameters.get("down_proj")
    name = type(mod).__name__
    if getattr(mod, "has_gate", False):
        gate_up = mod._parameters.get("gate_up_proj")
        if gate_up is None or down is None or gate_up.ndim != 3 or down.ndim != 3:
            return None
        apply_gate = getattr(type(mod), "_apply_gate", None)
        if getattr(apply_gate, "__name__", "") != "_default_apply_gate":
            return None  # its own gate split (interleaved halves, ...): not two contiguous row blocks
        e, two_i, h = gate_up.shape
        if two_i % 2 or down.shape != (e, h, two_i // 2):
            return None
        why = f"Hugging Face {name}: gate_up_proj is gate and up, each its own matrix"
        return {"gate_up_proj": (ExpertStack(e, (two_i // 2,) * 2), why),
                "down_proj": (ExpertStack(e, (h,)), f"Hugging Face {name}")}
    up = mod._parameters.get("up_proj")
    if up is None or down is None or up.ndim != 3 or down.ndim != 3:
        return None
    why = f"Hugging Face {name}"
    return {"up_proj": (ExpertStack(up.shape[0], (up.shape[1],)), why),
            "down_proj": (ExpertStack(down.shape[0], (down.shape[1],)), why)}


def _grouped_stacks(mod: nn.Module) -> Optional[dict[str, tuple[ExpertStack, str]]]:
    """torchtitan-style ``GroupedExperts`` (3-D ``w1``/``w2``/``w3``), or None."""
    if type(mod).__name__ != "GroupedExperts":
        return None
    ws = {n: mod._parameters.get(n) for n in ("w1", "w2", "w3")}
    if any(w is None or w.ndim != 3 for w in ws.values()):
        return None
    return {n: (ExpertStack(w.shape[0], (w.shape[1],)), "GroupedExperts (w1/w2/w3)") for n, w in ws.items()}


def auto_stacks(module: nn.Module) -> dict[str, tuple[ExpertStack, str]]:
    """fqn -> (stack, why) for every expert stack recognized automatically under ``module``."""
    out: dict[str, tuple[ExpertStack, str]] = {}
    for mod_name, mod in module.named_modules():
        found = _hf_stacks(mod) or _grouped_stacks(mod)
        for pname, decl in (found or {}).items():
            out.setdefault(f"{mod_name}.{pname}" if mod_name else pname, decl)
    return out


def expert_biases(module: nn.Module) -> dict[str, str]:
    """fqn -> why, for the per-expert biases ``[E, out]`` of Hugging Face experts modules (GPT-OSS's
    ``gate_up_proj_bias``, ``down_proj_bias``): two dimensions, but E bias vectors, not a matrix."""
    out: dict[str, str] = {}
    for mod_name, mod in module.named_modules():
        if not hasattr(mod, "has_gate") or not getattr(mod, "has_bias", False):
            continue
        for pname, p in mod._parameters.items():
            if p is not None and pname.endswith("_bias") and p.ndim == 2:
                out[f"{mod_name}.{pname}" if mod_name else pname] = f"per-expert bias of Hugging Face {type(mod).__name__}"
    return out


def declared_stacks(module: nn.Module, option: ExpertStacksOption = None) -> dict[str, tuple[ExpertStack, str]]:
    """fqn -> (stack, why) for every expert stack of ``module``: the automatic ones, then the
    option's (which win). A pattern that matches nothing, or a parameter it cannot be, is
    refused naming both."""
    out = auto_stacks(module)
    if option is None:
        return out
    named = list(module.named_parameters())
    if callable(option):
        for fqn, p in named:
            got = option(fqn, p)
            if got is None or got is False:
                continue
            if got is True:
                got = _stack_from_blocks(fqn, p, None)
            if not isinstance(got, ExpertStack):
                raise ExpertStackError(f"expert_stacks returned {got!r} for {fqn!r}; expected an ExpertStack, "
                                       "True, False or None")
            got.check(fqn, tuple(p.shape))
            out[fqn] = (got, "expert_stacks (callable)")
        return out
    for pattern, blocks in option:
        hits = [(fqn, p) for fqn, p in named if fnmatch.fnmatchcase(fqn, pattern)]
        if not hits:
            raise ExpertStackError(f"expert_stacks pattern {pattern!r} matches no parameter of the model")
        for fqn, p in hits:
            out[fqn] = (_stack_from_blocks(fqn, p, blocks), f"expert_stacks pattern {pattern!r}")
    return out
