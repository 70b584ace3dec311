"""The expert forward seams' one table (runtime/experts/seams.py FAMILIES): one entry per model
family, a module matched by the first entry that takes it, an unknown experts module left out
(its parameters stay dense), and an installed forward that is visible and can be removed.
In-process, plain stand-in modules: no transformers, no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.seams import FAMILIES, family_of, find_seams, install_forward
from lightning_matrixfsdp.runtime.experts.seam_family import InstalledSeam, SeamFamily, installed, uninstall
from lightning_matrixfsdp import parallelize_experts


class _Stacked(nn.Module):
    def __init__(self, e: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, 3, 3))


class TopK(_Stacked):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class GptOssLike(_Stacked):
    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        return hidden_states


class Grouped(_Stacked):
    def forward(self, x, num_tokens_per_expert):
        return x


class Unknown(_Stacked):
    """Stacked experts whose forward no family knows."""

    def forward(self, x, routing):
        return x


class OneArg(_Stacked):
    def forward(self, x):
        return x


def test_one_entry_per_family():
    assert [f.name for f in FAMILIES] == ["grouped", "gptoss", "topk"]
    assert all(isinstance(f, SeamFamily) for f in FAMILIES)
    assert len({type(f) for f in FAMILIES}) == len(FAMILIES)
    names = {type(m).__name__: getattr(family_of(m), "name", None)
             for m in (TopK(), GptOssLike(), parallelize_experts(Grouped()), Grouped(), Unknown())}
    assert names == {"TopK": "topk", "GptOssLike": "gptoss", "Grouped": None, "Unknown": None}
    assert family_of(parallelize_experts(Grouped())).name == "grouped"


def test_unknown_experts_module_is_no_seam_and_a_wrong_declaration_is_refused():
    root = nn.Sequential(Unknown(), TopK())
    assert [(s.fqn, s.kind) for s in find_seams(root)] == [("1", "topk")]  # the unknown one stays dense
    with pytest.raises(MatrixShardError, match=r"OneArg\.forward takes \('x',\).*forward\(x, "
                                               r"num_tokens_per_expert\)"):
        parallelize_experts(OneArg())


def test_installed_forward_is_visible_and_removable():
    calls = []

    def dispatch(hidden, index, weights, e, local, group):
        calls.append((index.flatten().tolist(), weights.flatten().tolist(), e, group))
        return local(hidden, [2, 0, 1, 1])

    module = parallelize_experts(Grouped())
    (seam,) = find_seams(nn.Sequential(module))
    install_forward(seam, dispatch, "g")
    assert isinstance(module.forward, InstalledSeam) and installed(module) is module.forward
    assert "grouped" in repr(module.forward) and "Grouped" in repr(module.forward)
    x = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(module(x, torch.tensor([2, 0, 1, 1])), x)
    assert calls == [([0, 0, 2, 3], [1.0] * 4, 4, "g")]  # rows of expert e get index e, weight 1
    uninstall(module)
    assert "forward" not in module.__dict__ and installed(module) is None
    assert torch.equal(module(x, torch.tensor([2, 0, 1, 1])), x) and len(calls) == 1
