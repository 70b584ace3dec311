"""Hugging Face MoE checkpoints that keep one matrix per expert, read by their owners, against transformers.

The Hub's Mixtral and Qwen3-MoE files, and what transformers' own ``save_pretrained`` writes,
hold ``...experts.N.w1/w2/w3`` (Mixtral, under ``block_sparse_moe``) or
``...experts.N.gate_proj/up_proj/down_proj`` (Qwen3-MoE); the models hold fused stacks. The oracle
is transformers itself: ``from_pretrained`` of the same directory. On the two Hugging Face gloo
workers, the model built with ``meta_init`` and sharded by ``matrix_shard`` (owners, and expert
parallelism at EP=2) loads the files with ``load_pretrained``; every weight this rank holds (whole
where it owns it, its experts of each stack under EP, its block of a split stack) must equal
``from_pretrained``'s bit for bit, and under EP each rank reads only its own experts' tensors.
A third directory is written here by hand in the Hub's Mixtral naming, from the reference's own
stacks (gate and up rows apart, bfloat16, spread over two files with an index); a fourth holds the
stacks fused (this library's export), of which each expert-parallel rank reads only its experts'
rows: in every case the ranks together read each byte of the files exactly once. Errors: a missing
expert, and a missing router that meta-device building left uninitialized (refused even with
``strict=False``, which the message does not suggest).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

CONFIGS = {"owners": {}, "ep2": {"expert_parallel_size": 2}}


def _tiny(kind: str):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=24, num_local_experts=4, **common))
    if kind == "mixtral_split":  # one layer of large experts: the planner splits each stack in two blocks
        common.update(vocab_size=16, num_hidden_layers=1)
        return MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4, **common))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                              head_dim=8, **common))


def _hub_mixtral(src: Path, dst: Path) -> None:
    """The Hub's Mixtral layout written by hand from a model's stacks: ``block_sparse_moe``, one
    ``w1`` (gate rows), ``w3`` (up rows), ``w2`` per expert, bfloat16, two files and an index."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        t = p.detach().to(torch.bfloat16)
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.w1.weight")] = t[e, :half].clone()
                tensors[name.replace("gate_up_proj", f"{e}.w3.weight")] = t[e, half:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[name.replace("down_proj", f"{e}.w2.weight")] = t[e].clone()
        else:
            tensors[name] = t.clone()
    dst.mkdir()
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, ks in halves.items():  # every other key: each stack's experts spread over both files
        save_file({k: tensors[k] for k in ks}, dst / file, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for kind in ("mixtral", "qwen3_moe", "mixtral_split"):
        _tiny(kind).save_pretrained(root / kind)
        out[kind] = str(root / kind)
    _hub_mixtral(root / "mixtral", root / "hub_mixtral")
    out["hub_mixtral"] = str(root / "hub_mixtral")
    _fused(root / "mixtral", root / "fused_mixtral")
    out["fused_mixtral"] = str(root / "fused_mixtral")
    return out


def _fused(src: Path, dst: Path) -> None:
    """The model's own keys, stacks fused (what this library's safetensors export writes)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    dst.mkdir()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())


def _file_bytes(d: str) -> int:
    """Bytes of every tensor in a directory's safetensors files."""
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for f in Path(d).glob("*.safetensors") for t in load_file(f).values())


def _held(ours: torch.nn.Module, ref: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what this rank holds of each parameter, the same part of from_pretrained's), placeholders left out."""
    from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned, shard_of

    want, have = {}, {}
    full = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        r = full[name].detach()
        s, shard = expert_slice_of(p), shard_of(p)
        if s is not None:
            r = r[s.first:s.first + s.count]
        elif not is_owned(p):
            continue
        elif shard is not None and shard.experts is not None:
            r = r[shard.experts[0]:shard.experts[1]]
        want[name], have[name] = r, p.detach()
    return want, have


def _load(d: str, kw: dict, strict: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf

    with mf.meta_init():
        ours = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    mf.matrix_shard(ours, **kw)
    return ours, mf.load_pretrained(ours, d, strict=strict)


def load_worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    from transformers import AutoModelForCausalLM

    from lightning_matrixfsdp.runtime.tags import shard_of

    out: dict[Any, Any] = {}
    for name, d in dirs.items():
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        for cfg, kw in CONFIGS.items():
            ours, report = _load(d, kw)
            want, have = _held(ours, ref)
            out[name, cfg] = {
                "differ": sorted(n for n in want if have[n].dtype != want[n].dtype or not torch.equal(have[n], want[n])),
                "stacks": sorted(n for n in have if n.endswith(("gate_up_proj", "down_proj"))),
                "experts_read": sorted({int(m.group(1)) for k in report.read
                                        for m in [re.search(r"experts\.(\d+)\.", k)] if m}),
                "blocks": sorted((n, shard_of(p).experts) for n, p in ours.named_parameters()
                                 if shard_of(p) is not None and shard_of(p).experts is not None),
                "files": len(report.files), "bytes": report.bytes_read}
    return out


def error_worker(rank: int, world: int, cases: dict[str, tuple[str, bool]], full: str) -> dict:
    import warnings

    import lightning_matrixfsdp as mf

    out: dict[str, Any] = {}
    for name, (d, strict) in cases.items():
        try:
            _load(d, CONFIGS["ep2"], strict=strict)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads the class and the words
            out[name] = (type(e).__name__, str(e))
    # once loaded, the router holds values: a later partial load with strict=False may leave it as it is
    model, _ = _load(full, CONFIGS["ep2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mf.load_pretrained(model, cases["no_router"][0], strict=False)
    out["after_full_load"] = [str(w.message) for w in caught if "keep their values" in str(w.message)]
    return out


def test_per_expert_files_load_as_from_pretrained(dirs, hf_pool) -> None:
    res = hf_pool.run(load_worker, dirs, timeout=300)
    for rank, r in enumerate(res):
        for (name, cfg), got in r.items():
            assert got["differ"] == [], f"rank {rank}, {name}, {cfg}: differs from from_pretrained: {got['differ']}"
        assert r["hub_mixtral", "owners"]["files"] == 2
        # under EP each rank read its own experts' tensors only, and holds its experts of every stack
        for name in dirs:
            want = [] if name == "fused_mixtral" else [2 * rank, 2 * rank + 1]  # fused: no per-expert keys
            assert r[name, "ep2"]["experts_read"] == want, (name, r[name, "ep2"])
            assert len(r[name, "ep2"]["stacks"]) == (2 if name == "mixtral_split" else 4)
    for key in res[0]:  # each tensor's bytes read once in all, by the ranks holding them (EP: experts apart)
        assert sum(r[key]["bytes"] for r in res) == _file_bytes(dirs[key[0]]), key
    owned = [set(r["mixtral", "owners"]["stacks"]) for r in res]  # owners: every stack on one rank or the other
    assert len(owned[0] | owned[1]) == 4 and not owned[0] & owned[1], owned
    for rank, r in enumerate(res):  # split stacks: each rank its block of experts of each stack, read into it
        blocks = [(n, (2 * rank, 2 * rank + 2)) for n in ("model.layers.0.mlp.experts.down_proj",
                                                          "model.layers.0.mlp.experts.gate_up_proj")]
        assert r["mixtral_split", "owners"]["blocks"] == blocks, r["mixtral_split", "owners"]["blocks"]


def test_fragments_of_a_stack_take_their_rows_and_columns_of_each_expert(tmp_path) -> None:
    """In process: each rank's part of a stack (an expert slice or block, a TP fragment along the rows,
    which cross the gate/up seam, or along the columns) read from per-expert files equals that part
    of the stack joined plainly here (``gate_up[e] = cat(gate_e, up_e)``)."""
    from safetensors.torch import save_file

    from lightning_matrixfsdp.checkpoint.expert_files import find_fused, fused_reads
    from lightning_matrixfsdp.checkpoint.pretrained import _read, safetensors_layout

    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(4, 6, 5, generator=g), torch.randn(4, 6, 5, generator=g)
    files = {f"m.experts.{e}.{n}.weight": t[e].clone() for e in range(4) for n, t in (("gate_proj", gate), ("up_proj", up))}
    save_file(files, tmp_path / "model.safetensors")
    layout = safetensors_layout(tmp_path)
    whole = torch.cat([gate, up], dim=1)  # [E, 12, 5]
    fs = find_fused(["m.experts.gate_up_proj"], whole.shape, layout)
    assert fs is not None and not fs.missing
    for part in (None, (0, 1, 2), (1, 0, 4), (1, 4, 5), (1, 9, 3), (2, 1, 3)):
        want = whole if part is None else whole.narrow(*part)
        dst = torch.full_like(want, float("nan"))
        _read(fused_reads(fs, layout, dst, part))
        assert torch.equal(dst, want), part


def test_incomplete_or_uninitialized_experts_are_refused(dirs, tmp_path, hf_pool) -> None:
    from safetensors.torch import load_file, save_file

    src = Path(dirs["qwen3_moe"])
    sd = load_file(src / "model.safetensors")
    cases = {}
    for name, drop in (("no_expert", "model.layers.1.mlp.experts.3.up_proj.weight"),
                       ("no_router", "model.layers.0.mlp.gate.weight")):
        d = tmp_path / name
        d.mkdir()
        save_file({k: v for k, v in sd.items() if k != drop}, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text((src / "config.json").read_text())
        cases[name] = (str(d), True)
    cases["no_router_not_strict"] = (cases["no_router"][0], False)
    res = hf_pool.run(error_worker, cases, str(src), timeout=300)
    for r in res:  # every rank alike
        kind, msg = r["no_expert"]
        assert kind == "CheckpointMismatchError" and "model.layers.1.mlp.experts.3.up_proj.weight" in msg, msg
        assert "model.layers.1.mlp.experts.gate_up_proj" in msg, msg
        for case in ("no_router", "no_router_not_strict"):
            kind, msg = r[case]
            assert kind == "CheckpointKeyError", r[case]
            assert "model.layers.0.mlp.gate.weight" in msg and "uninitialized" in msg, msg
            assert "strict=False loads" not in msg, msg
    assert "model.layers.0.mlp.gate.weight" in res[0]["after_full_load"][0], res[0]["after_full_load"]
