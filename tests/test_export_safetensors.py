"""``python -m lightning_matrixfsdp.consolidate CKPT OUT --format safetensors``: Hugging Face
``from_pretrained`` loads the export with no missing key, tied weights included, and every
weight equals the trained model's bit for bit.

Tiny ``LlamaForCausalLM`` (tied embeddings) and ``GPT2LMHeadModel`` (tied, Conv1D), built from
configs, train two steps under ``Trainer(strategy="matrix_fsdp")`` on 2 gloo processes and save a
checkpoint directory and a consolidated file. The reference weights are gathered from the
owners by broadcast (``tests/helpers/lit.gather_full``), not read back through the checkpoint code.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
VOCAB, SEQ = 64, 16  # what tests/helpers/lit.TokenData produces


def build(name: str) -> torch.nn.Module:
    """A tiny, randomly initialized model with tied input embedding and LM head."""
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=2 * SEQ, tie_word_embeddings=True))
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def train_and_save(rank: int, world: int, name: str, root: str) -> Any:
    """Two steps under the Trainer strategy; a checkpoint directory, a consolidated file, the
    config, and (rank 0) the trained model's full weights gathered from their owners."""
    from lightning.pytorch import LightningModule, Trainer

    import lightning_matrixfsdp as mf
    from helpers.lit import TokenData, gather_full
    from helpers.models import lm_loss

    class LitLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(name)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.model(batch, use_cache=False).logits, batch)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(TokenData(vocab=VOCAB, seq=SEQ), batch_size=2)

        def configure_optimizers(self) -> Any:
            return mf.Muon(self.parameters(), lr=0.02, adamw_lr=3e-3)

    torch.manual_seed(0)
    lit = LitLM()
    initial = {k: v.detach().clone() for k, v in lit.model.state_dict().items()}
    trainer = Trainer(strategy="matrix_fsdp", accelerator="cpu", devices=world, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, default_root_dir=root)
    trainer.fit(lit)
    trainer.save_checkpoint(f"{root}/dir.ckpt")  # the strategy's default: a directory
    trainer.strategy._save_distributed_checkpoint = False
    trainer.save_checkpoint(f"{root}/file.ckpt")  # one consolidated file
    full = gather_full(lit.model)
    if rank != 0:
        return None
    lit.model.config.save_pretrained(f"{root}/config")
    changed = [k for k in full if not torch.equal(full[k], initial[k])]
    return {"full": full, "changed": changed}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf_pool) -> dict[str, tuple[Path, dict]]:
    """Each model trained once on 2 processes (the Hugging Face files' pool, tests/conftest.py):
    {name: (root, rank 0's result)}."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    out = {}
    for name in ("llama", "gpt2"):
        root = tmp_path_factory.mktemp(name)
        out[name] = (root, hf_pool.run(train_and_save, name, str(root), timeout=300)[0])
    return out


def _load(path: Path) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)


def _check_loaded(model: torch.nn.Module, info: dict, full: dict[str, torch.Tensor]) -> None:
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tie lost"
    sd = model.state_dict()
    assert set(sd) == set(full), set(sd) ^ set(full)
    for k, v in full.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), f"{k} differs from the trained weight"


def _stored(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_export_from_directory_and_file_loads_with_from_pretrained(name: str, trained, tmp_path: Path) -> None:
    from lightning_matrixfsdp.consolidate import main

    root, res = trained[name]
    assert len(res["changed"]) > len(res["full"]) // 2, "the model did not train"
    embed = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}[name]
    assert "lm_head.weight" not in res["full"]  # named_parameters() names a tied parameter once
    full = dict(res["full"], **{"lm_head.weight": res["full"][embed]})  # state_dict() names it twice

    # a checkpoint directory -> OUT directory, config copied in with --config
    out = tmp_path / "from_dir"
    assert main([str(root / "dir.ckpt"), str(out), "--format", "safetensors", "--strip-prefix", "model.",
                 "--config", str(root / "config" / "config.json")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    stored = _stored(out / "model.safetensors")
    assert embed in stored and "lm_head.weight" not in stored  # stored once, as save_pretrained does
    assert set(stored) == set(full) - {"lm_head.weight"}
    _check_loaded(*_load(out), full)

    # a consolidated file -> OUT ending in .safetensors, config given as the directory holding it
    out2 = tmp_path / "from_file" / "model.safetensors"
    assert main([str(root / "file.ckpt"), str(out2), "--format", "safetensors", "--strip-prefix", "model.",
                 "--config", str(root / "config")]) == 0
    assert set(_stored(out2)) == set(stored)
    _check_loaded(*_load(out2.parent), full)


def test_dtype_cast_and_library_call(trained, tmp_path: Path) -> None:
    from lightning_matrixfsdp.checkpoint.export import export_safetensors

    root, res = trained["llama"]
    r = export_safetensors(root / "file.ckpt", tmp_path / "bf16", strip_prefix="model.", dtype="bfloat16",
                           config=root / "config")
    assert r.path == tmp_path / "bf16" / "model.safetensors"
    assert r.tied == {"lm_head.weight": "model.embed_tokens.weight"} and r.dropped == []
    stored = _stored(r.path)
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    assert all(torch.equal(v, res["full"][k].to(torch.bfloat16)) for k, v in stored.items())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(r.path.parent), dtype=torch.bfloat16)
    assert torch.equal(model.lm_head.weight, res["full"]["model.embed_tokens.weight"].to(torch.bfloat16))


def test_add_prefix_and_plain_state_dict_with_shared_storage(tmp_path: Path) -> None:
    """A plain state_dict file (no layout record): a tie is found by shared storage and stored
    once; a slice view of another tensor gets its own copy; integer tensors keep their dtype."""
    pytest.importorskip("safetensors")
    from lightning_matrixfsdp.checkpoint.export import export_safetensors

    w = torch.randn(4, 3)
    big = torch.arange(12.0)
    sd = {"emb.weight": w, "head.weight": w, "part.a": big[:6], "part.b": big[6:], "steps": torch.tensor([1, 2])}
    torch.save(sd, tmp_path / "plain.pt")
    r = export_safetensors(tmp_path / "plain.pt", tmp_path / "out.safetensors", add_prefix="backbone.",
                           dtype=torch.float16)
    stored = _stored(r.path)
    assert sorted(stored) == ["backbone.emb.weight", "backbone.part.a", "backbone.part.b", "backbone.steps"]
    assert r.tied == {"backbone.head.weight": "backbone.emb.weight"}
    assert torch.equal(stored["backbone.emb.weight"], w.half())
    assert torch.equal(stored["backbone.part.b"], big[6:].half())
    assert stored["backbone.steps"].dtype == torch.int64
    # without a cast the views still share memory: each is written as its own contiguous copy
    torch.save({"a": big[:6], "b": big[6:], "w": w, "wt": w.t()}, tmp_path / "views.pt")
    stored = _stored(export_safetensors(tmp_path / "views.pt", tmp_path / "views.safetensors").path)
    assert torch.equal(stored["b"], big[6:]) and torch.equal(stored["wt"], w.t()) and torch.equal(stored["w"], w)


def test_errors(trained, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_matrixfsdp.checkpoint.export import export_safetensors
    from lightning_matrixfsdp.consolidate import main

    root, _ = trained["gpt2"]
    src = str(root / "dir.ckpt")
    out = tmp_path / "out"
    # a prefix that matches nothing names the first keys
    with pytest.raises(ValueError, match=r"--strip-prefix 'encoder\.' matches no key.*first keys are: "
                                         r"model\.transformer\.wte\.weight"):
        main([src, str(out), "--format", "safetensors", "--strip-prefix", "encoder."])
    # an unknown format, and export options without --format
    with pytest.raises(SystemExit):
        main([src, str(out), "--format", "onnx"])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([src, str(out), "--strip-prefix", "model."])
    assert "--strip-prefix only apply with --format safetensors" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([src, str(out), "--format", "safetensors", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype 'float64' is not one of bfloat16, float16, float32"):
        export_safetensors(src, out, dtype="float64")
    # non-tensor entries
    torch.save({"a.weight": torch.ones(2, 2), "a.count": 3, "a.name": "x"}, tmp_path / "objs.pt")
    with pytest.raises(TypeError, match=r"not tensors: a\.count \(int\), a\.name \(str\)"):
        export_safetensors(tmp_path / "objs.pt", out)
    # OUT that is an existing file without the .safetensors suffix; a config that is not there
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile is an existing file"):
        export_safetensors(src, tmp_path / "afile")
    with pytest.raises(FileNotFoundError, match="--config .*nothere"):
        export_safetensors(src, out, config=tmp_path / "nothere")
    assert not out.exists()  # nothing written by any failed call
    # safetensors missing: the extra to install, before anything is read or written
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'pip install "lightning-matrixfsdp\[hf\]"'):
        main([src, str(out), "--format", "safetensors"])
    assert not out.exists()


def test_cli_reports_ties_left_out_keys_and_missing_config(trained, tmp_path: Path, capsys) -> None:
    from lightning_matrixfsdp.consolidate import main

    root, _ = trained["llama"]
    assert main([str(root / "dir.ckpt"), str(tmp_path / "o"), "--format", "safetensors",
                 "--strip-prefix", "model.model."]) == 0
    text = capsys.readouterr().out
    assert "left out (not under --strip-prefix 'model.model.'): model.lm_head.weight" in text
    assert "needs a config.json there (--config PATH)" in text
    stored = _stored(tmp_path / "o" / "model.safetensors")
    assert "embed_tokens.weight" in stored and "norm.weight" in stored and not any("lm_head" in k for k in stored)
    assert "tied:" not in text  # the LM head's name is outside the prefix: left out, not a tie
