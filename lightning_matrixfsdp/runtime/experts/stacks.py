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
  and GPT-OSS's transposed layout ``[E, in, out]`` with gate and up interleaved; and for
  torchtitan-style ``GroupedExperts`` (3-D ``w1``/``w2``/``w3``);
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

__all__ = ["ExpertStack", "ExpertStacksOption", "StackLayout", "auto_stacks", "check_expert_stacks", "declared_stacks",
           "expert_biases"]


class ExpertStackError(ValueError):
    """A stack declaration that does not fit its parameter (a ``MatrixShardError`` in spirit;
    defined here so this module stays below ``options.py``)."""


@dataclass(frozen=True)
class ExpertStack:
    """A parameter ``[E, a, b]`` holding ``num_experts`` matrices, each made of row blocks.

    Each expert matrix is taken in ``nn.Linear``'s orientation ``(out, in)``: ``p[e]`` itself
    (stored ``[E, out, in]``, the ``F.linear`` layout), or ``p[e].T`` when ``transposed``
    (stored ``[E, in, out]``, the ``x @ W`` layout of GPT-OSS). Its ``out`` rows are cut into
    ``blocks`` (``sum(blocks) == out``): ``(I, I)`` for a fused gate/up projection, ``(out,)``
    for a plain stack. The blocks are contiguous row ranges, or, when ``interleaved`` (equal
    blocks only), block ``j`` is every ``k``-th row from row ``j`` (``k = len(blocks)``: GPT-OSS's
    gate ``[..., ::2]`` and up ``[..., 1::2]``). Each block is orthogonalized, its learning rate
    adjusted and priced as an ``(out_j, in)`` matrix of its own.
    """

    num_experts: int
    blocks: tuple[int, ...]
    #: stored ``[E, in, out]``: each expert matrix is ``p[e].T``
    transposed: bool = False
    #: the blocks are interleaved rows (block j: rows ``j::len(blocks)``), not contiguous ranges
    interleaved: bool = False

    def __post_init__(self) -> None:
        blocks = tuple(self.blocks) if isinstance(self.blocks, (list, tuple)) else self.blocks
        object.__setattr__(self, "blocks", blocks)
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ExpertStackError(f"ExpertStack.num_experts must be a positive int, got {self.num_experts!r}")
        if (not isinstance(blocks, tuple) or not blocks
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks)):
            raise ExpertStackError(f"ExpertStack.blocks must be a non-empty tuple of positive ints, got {blocks!r}")
        for name in ("transposed", "interleaved"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ExpertStackError(f"ExpertStack.{name} must be True or False, got {value!r} "
                                       f"({type(value).__name__})")
        if self.interleaved and (len(blocks) < 2 or len(set(blocks)) != 1):
            raise ExpertStackError(f"ExpertStack.interleaved needs at least two equal blocks (block j is every "
                                   f"{len(blocks)}-th row from row j), got blocks {blocks!r}")

    @property
    def rows(self) -> int:
        """Rows of one expert matrix in ``nn.Linear`` orientation (its ``out`` features)."""
        return sum(self.blocks)

    @property
    def row_dim(self) -> int:
        """The dimension of the stored parameter holding those rows (2 when ``transposed``, else 1)."""
        return 2 if self.transposed else 1

    def matrices(self, cols: int) -> list[tuple[int, int]]:
        """The ``(out, in)`` shape of each matrix one expert is stepped as (one per block);
        ``cols``: the expert's ``in`` features (:meth:`matrix_shapes` reads them off a shape)."""
        return [(b, int(cols)) for b in self.blocks]

    def matrix_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """:meth:`matrices` of a stored parameter ``shape`` ``[E, a, b]``, whatever its orientation."""
        return self.matrices(int(shape[3 - self.row_dim]))

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether ``shape`` is a stack of these matrices (any number of experts: a local slice fits)."""
        return len(shape) == 3 and int(shape[self.row_dim]) == self.rows

    def pieces(self, t: Any) -> list[tuple[int, slice, Any]]:
        """``(expert, row slice, view)`` for every expert of ``t.shape[0]`` and every block: ``view``
        is that block's ``(out_j, in)`` matrix as a view of ``t`` (shaped like the parameter; a
        strided view when ``transposed`` or ``interleaved``), the row slice its rows in the
        expert's ``(out, in)`` matrix."""
        k = len(self.blocks)
        out = []
        for e in range(t.shape[0]):
            m = t[e].T if self.transposed else t[e]
            start = 0
            for j, rows in enumerate(self.blocks):
                cut = slice(j, None, k) if self.interleaved else slice(start, start + rows)
                out.append((e, cut, m[cut]))
                start += rows
        return out

    def check(self, fqn: str, shape: tuple[int, ...]) -> None:
        """Refuse a declaration that does not fit the whole parameter ``shape``."""
        if len(shape) != 3:
            raise ExpertStackError(f"parameter {fqn!r} of shape {tuple(shape)} is declared an expert stack, "
                                   "which needs three dimensions [experts, rows, cols]")
        if int(shape[0]) != self.num_experts or not self.fits(shape):
            where = "cols (stored transposed, [experts, in, out])" if self.transposed else "rows"
            raise ExpertStackError(
                f"parameter {fqn!r} of shape {tuple(shape)} does not fit its expert stack declaration "
                f"({self.num_experts} experts of {self.rows} {where} in blocks {self.blocks})")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"num_experts": self.num_experts, "blocks": list(self.blocks)}
        # the layout flags only when set: the declarations (and plan digests) of earlier plans stay valid
        if self.transposed:
            d["transposed"] = True
        if self.interleaved:
            d["interleaved"] = True
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ExpertStack":
        return ExpertStack(int(d["num_experts"]), tuple(int(b) for b in d["blocks"]),
                           d.get("transposed", False), d.get("interleaved", False))

    def describe(self) -> str:
        split = ""
        if len(self.blocks) > 1:
            split = f", each as {len(self.blocks)} {'interleaved ' if self.interleaved else ''}blocks {self.blocks}"
        stored = ", stored transposed [E, in, out]" if self.transposed else ""
        return f"{self.num_experts} experts{split}{stored}"


@dataclass(frozen=True)
class StackLayout:
    """One pattern's declaration in the ``expert_stacks`` option's mapping form
    ``{"blocks": ..., "transposed": bool, "interleaved": bool}`` (see :class:`ExpertStack`)."""

    blocks: Union[None, int, tuple[int, ...]] = None
    transposed: bool = False
    interleaved: bool = False


#: The ``expert_stacks`` option once checked: None, a tuple of (fqn pattern, blocks) pairs
#: (blocks: None for a plain stack, an int k for k equal row blocks, a tuple of row sizes, or a
#: :class:`StackLayout` for a stack stored transposed or with interleaved blocks), or a callable
#: ``(fqn, param) -> ExpertStack | bool | None``.
ExpertStacksOption = Union[None, tuple, Callable[[str, nn.Parameter], Any]]

_FORMS = ("None, an fqn glob pattern or a list of them (each matching 3-D parameter a plain stack), a dict "
          "{pattern: blocks} (blocks: an int k for k equal row blocks, e.g. 2 for a fused gate/up, a list of "
          "row sizes, or a dict {'blocks': ..., 'transposed': bool, 'interleaved': bool} for experts stored "
          "[E, in, out] or with interleaved blocks), or a callable (fqn, param) -> ExpertStack | bool | None")
_LAYOUT_KEYS = ("blocks", "transposed", "interleaved")


def _check_blocks(value: Any, name: str, pattern: str) -> Union[None, int, tuple[int, ...], StackLayout]:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in value)):
        return tuple(int(b) for b in value)
    if isinstance(value, dict):
        return _check_layout(value, name, pattern)
    raise ExpertStackError(f"{name}=...{{{pattern!r}: {value!r}}}: the blocks of pattern {pattern!r} are {value!r} ({type(value).__name__}); "
                           "expected None, a positive int (that many equal row blocks), a list of positive "
                           "row sizes, or a dict with keys 'blocks', 'transposed', 'interleaved'")


def _check_layout(value: dict, name: str, pattern: str) -> StackLayout:
    """The mapping form of one pattern's declaration, every key checked."""
    where = f"{name}=...{{{pattern!r}: {value!r}}}"
    unknown = [k for k in value if k not in _LAYOUT_KEYS]
    if unknown:
        raise ExpertStackError(f"{where}: unknown key(s) {unknown!r}; a layout takes {list(_LAYOUT_KEYS)}")
    if isinstance(value.get("blocks"), dict):
        raise ExpertStackError(f"{where}: 'blocks' is a dict; expected None, a positive int or a list of row sizes")
    blocks = _check_blocks(value.get("blocks"), name, pattern)
    flags = {}
    for key in ("transposed", "interleaved"):
        flag = value.get(key, False)
        if not isinstance(flag, bool):
            raise ExpertStackError(f"{where}: {key!r} is {flag!r} ({type(flag).__name__}); expected true or false")
        flags[key] = flag
    if flags["interleaved"]:
        equal = (isinstance(blocks, int) and blocks >= 2) or (
            isinstance(blocks, tuple) and len(blocks) >= 2 and len(set(blocks)) == 1)
        if not equal:
            raise ExpertStackError(f"{where}: 'interleaved' needs 'blocks' of at least two equal blocks (an int "
                                   f"k >= 2, or a list of equal sizes), got {blocks!r}")
    return StackLayout(blocks, **flags)


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


def _stack_from_blocks(fqn: str, p: nn.Parameter,
                       blocks: Union[None, int, tuple[int, ...], StackLayout]) -> ExpertStack:
    if p.ndim != 3:
        raise ExpertStackError(f"expert_stacks declares {fqn!r} a stack, but it has shape {tuple(p.shape)}; a stack "
                               "has three dimensions [experts, rows, cols]")
    layout = blocks if isinstance(blocks, StackLayout) else StackLayout(blocks)
    blocks = layout.blocks
    rows = int(p.shape[2 if layout.transposed else 1])
    what = "out features (the last dimension: stored transposed)" if layout.transposed else "rows"
    if blocks is None:
        sizes: tuple[int, ...] = (rows,)
    elif isinstance(blocks, int):
        if rows % blocks:
            raise ExpertStackError(f"expert_stacks splits {fqn!r} ({what} {rows}) into {blocks} equal blocks, "
                                   "which do not divide it")
        sizes = (rows // blocks,) * blocks
    else:
        sizes = tuple(blocks)
    stack = ExpertStack(int(p.shape[0]), sizes, layout.transposed, layout.interleaved)
    stack.check(fqn, tuple(p.shape))
    return stack


# ---------------------------------------------------------------------- automatic
#: ``_apply_gate`` of the Hugging Face experts modules known to split ``gate_up`` interleaved
#: (gate ``[..., ::2]``, up ``[..., 1::2]``), by qualified name: GPT-OSS.
_INTERLEAVED_GATES = frozenset({"GptOssExperts._apply_gate"})


def _hf_stacks(mod: nn.Module) -> Optional[dict[str, tuple[ExpertStack, str]]]:
    """A Hugging Face experts module (marked by ``use_experts_implementation``) whose layout its
    own flags and gate split say, or None: ``is_transposed`` (stored ``[E, in, out]``: GPT-OSS;
    else the ``F.linear`` layout: Mixtral, ...), and gate and up as the contiguous halves of the
    out features (the library's default split) or interleaved (GPT-OSS's ``_apply_gate``). A gate
    split of its own that we do not know is not declared (its stacks warn)."""
    if not hasattr(mod, "has_gate"):
        return None
    transposed = getattr(mod, "is_transposed", None)
    if not isinstance(transposed, bool):
        return None
    down = mod._parameters.get("down_proj")
    name = type(mod).__name__
    if getattr(mod, "has_gate", False):
        gate_up = mod._parameters.get("gate_up_proj")
        if gate_up is None or down is None or gate_up.ndim != 3 or down.ndim != 3:
            return None
        apply_gate = getattr(type(mod), "_apply_gate", None)
        interleaved = getattr(apply_gate, "__qualname__", "") in _INTERLEAVED_GATES
        if getattr(apply_gate, "__name__", "") != "_default_apply_gate" and not interleaved:
            return None  # its own gate split, unknown here: not declared (an undeclared stack warns)
        if transposed:  # [E, H, 2I] and [E, I, H]: x @ W, each expert matrix is W.T
            e, h, two_i = gate_up.shape
            fits = not two_i % 2 and down.shape == (e, two_i // 2, h)
        else:  # [E, 2I, H] and [E, H, I]: F.linear
            e, two_i, h = gate_up.shape
            fits = not two_i % 2 and down.shape == (e, h, two_i // 2)
        if not fits:
            return None
        how = " interleaved" if interleaved else ""
        why = f"Hugging Face {name}: gate_up_proj is gate and up{how}, each its own matrix"
        return {"gate_up_proj": (ExpertStack(e, (two_i // 2,) * 2, transposed, interleaved), why),
                "down_proj": (ExpertStack(e, (h,), transposed), f"Hugging Face {name}")}
    up = mod._parameters.get("up_proj")
    if up is None or down is None or up.ndim != 3 or down.ndim != 3:
        return None
    why = f"Hugging Face {name}"
    out = 2 if transposed else 1  # the dimension of the out features (is_transposed: [E, in, out])
    return {"up_proj": (ExpertStack(up.shape[0], (up.shape[out],), transposed), why),
            "down_proj": (ExpertStack(down.shape[0], (down.shape[out],), transposed), why)}


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
