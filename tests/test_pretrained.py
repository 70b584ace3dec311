"""Pretrained weights read by their owners (``load_pretrained``) equal ``from_pretrained`` + sharding, bit for bit.

Tiny Llama and GPT-2 models built from configs are saved with ``save_pretrained`` (one
``model.safetensors``, or shards with ``model.safetensors.index.json``). On 2 gloo processes,
the reference loads them with ``from_pretrained`` and shards; the path under test builds the
model with its parameters on the meta device, shards it and reads each rank's owned tensors.
Every parameter must be equal on its owner (dtype included), every buffer on every rank, and
a few Muon steps must give the same losses and weights. Errors name the keys and the file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LAYER = {"llama": "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
         "gpt2": "transformers.models.gpt2.modeling_gpt2.GPT2Block"}
VOCAB, SEQ = 64, 16


@pytest.fixture(scope="module")
def pool(hf_pool):
    """The Hugging Face files' two gloo workers (tests/conftest.py): transformers is imported
    once per process, not per test or per file."""
    return hf_pool


def save(tmp: Path, model: str, shards: bool, **kw: Any) -> str:
    """A randomly initialized tiny model saved with ``save_pretrained`` (small shards with ``shards``)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model == "llama":
        m = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                         use_cache=False, **kw))
    else:
        m = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **kw))
    out = tmp / f"{model}{'-sharded' if shards else ''}"
    m.save_pretrained(out, max_shard_size="8KB" if shards else "10GB")
    assert (out / "model.safetensors.index.json").is_file() == shards
    return str(out)


def _train(model: torch.nn.Module, rank: int, steps: int) -> list[float]:
    from helpers.equiv import make_sharded_optimizer
    from helpers.models import batch_for, lm_loss

    opts = make_sharded_optimizer(model, "ours")
    losses = []
    for step in range(steps):
        idx = batch_for(step, rank)
        loss = lm_loss(model(idx).logits.float(), idx)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def owned(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from lightning_matrixfsdp.runtime.tags import is_owned

    return {n: p.detach().clone() for n, p in model.named_parameters() if is_owned(p)}


def compare_worker(rank: int, world: int, cfg: dict) -> dict:
    """from_pretrained + matrix_shard against meta_init + matrix_shard + load_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf

    dtype = getattr(torch, cfg.get("dtype", "float32"))
    ref = AutoModelForCausalLM.from_pretrained(cfg["dir"], dtype=dtype)
    mf.matrix_shard(ref, wrap_policy=LAYER[cfg["model"]])
    with mf.meta_init():
        ours = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["dir"]), dtype=dtype)
    assert all(p.is_meta for p in ours.parameters()) and not any(b.is_meta for b in ours.buffers())
    mf.matrix_shard(ours, wrap_policy=LAYER[cfg["model"]])
    report = mf.load_pretrained(ours, cfg["dir"])
    want, have = owned(ref), owned(ours)
    assert set(want) == set(have) and have, (sorted(want), sorted(have))
    bad = [n for n in want if want[n].dtype != have[n].dtype or not torch.equal(want[n], have[n])]
    assert not bad, f"rank {rank}: parameters differ from from_pretrained: {bad}"
    rb, ob = dict(ref.named_buffers()), dict(ours.named_buffers())
    assert set(rb) == set(ob) and all(torch.equal(rb[k], ob[k]) for k in rb), "buffers differ"
    tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    ref_losses, our_losses = _train(ref, rank, 3), _train(ours, rank, 3)
    assert ref_losses == our_losses, (ref_losses, our_losses)
    want, have = owned(ref), owned(ours)
    assert all(torch.equal(want[n], have[n]) for n in want), "weights differ after training"
    return {"read": list(report.read), "files": len(report.files), "tied": tied, "losses": our_losses,
            "owned": sorted(want)}


CASES = {
    "llama_single_file": {"model": "llama"},
    "llama_tied_sharded_index": {"model": "llama", "shards": True, "config": {"tie_word_embeddings": True}},
    "gpt2_single_file": {"model": "gpt2"},
    "gpt2_sharded_index_to_bfloat16": {"model": "gpt2", "shards": True, "dtype": "bfloat16"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_load_pretrained_equals_from_pretrained_then_shard(case: str, tmp_path: Path, pool) -> None:
    cfg = dict(CASES[case])
    cfg["dir"] = save(tmp_path, cfg["model"], cfg.get("shards", False), **cfg.get("config", {}))
    res = pool.run(compare_worker, cfg, timeout=240)
    r0, r1 = res
    assert r0["files"] > 1 if cfg.get("shards") else r0["files"] == 1
    assert not (set(r0["owned"]) & set(r1["owned"])) and r0["owned"] and r1["owned"]
    assert r0["losses"][-1] != r0["losses"][0]
    if cfg["model"] == "gpt2" or cfg.get("config", {}).get("tie_word_embeddings"):
        assert r0["tied"] is True


def read_worker(rank: int, world: int, cfg: dict) -> dict:
    """What each rank read: the keys of the tensors it owns, and the buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import is_owned

    with mf.meta_init():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["dir"]))
    mf.matrix_shard(model, wrap_policy=LAYER["llama"])
    report = mf.load_pretrained(model, cfg["dir"])
    placeholders = [n for n, p in model.named_parameters() if not is_owned(p) and p.numel() != 0]
    return {"read": sorted(report.read), "owned": sorted(n for n, p in model.named_parameters() if is_owned(p)),
            "placeholders": placeholders, "bytes": report.bytes_read}


def test_each_rank_reads_only_what_it_owns(tmp_path: Path, pool) -> None:
    d = save(tmp_path, "llama", False)
    res = pool.run(read_worker, {"dir": d}, timeout=240)
    for r in res:
        assert r["read"] == r["owned"], (r["read"], r["owned"])  # Llama keeps no persistent buffer
        assert not r["placeholders"]
    from safetensors import safe_open

    with safe_open(Path(d) / "model.safetensors", "pt") as f:
        total = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    assert res[0]["bytes"] + res[1]["bytes"] == total and 0 < res[0]["bytes"] < total


def error_worker(rank: int, world: int, config: str, cases: list[dict]) -> list[dict]:
    """Each case on a fresh meta-built, sharded model: the error class and message, or None."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf

    out = []
    for case in cases:
        with mf.meta_init():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))
        mf.matrix_shard(model, wrap_policy=LAYER["llama"])
        try:
            mf.load_pretrained(model, case["dir"], **case.get("kw", {}))
            out.append({"error": None})
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out.append({"error": type(e).__name__, "message": str(e)})
    return out


def test_missing_unexpected_and_misshapen_keys_fail_on_every_rank_naming_key_and_file(tmp_path: Path, pool) -> None:
    from safetensors.torch import load_file, save_file

    d = Path(save(tmp_path, "llama", False))
    sd = load_file(d / "model.safetensors")
    missing = dict(sd)
    del missing["model.layers.1.mlp.up_proj.weight"]
    cases = {
        "missing": (missing, "CheckpointKeyError", ["model.layers.1.mlp.up_proj.weight", "missing"]),
        "unexpected": (dict(sd, **{"model.extra.weight": torch.zeros(2, 2)}), "CheckpointKeyError",
                       ["model.extra.weight", "unexpected", "model.safetensors"]),
        "shape": (dict(sd, **{"model.norm.weight": torch.zeros(7)}), "CheckpointMismatchError",
                  ["model.norm.weight", "[7]", "[32]", "model.safetensors"]),
        "integer": (dict(sd, **{"model.norm.weight": torch.zeros(32, dtype=torch.int32)}),
                    "CheckpointMismatchError", ["model.norm.weight", "I32"]),
    }
    runs = []
    for name, (tensors, _, _) in cases.items():
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        runs.append({"dir": str(tmp_path / name)})
    runs.append({"dir": str(tmp_path / "unexpected"), "kw": {"strict": False}})  # strict=False loads the rest
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    runs.append({"dir": str(tmp_path / "broken")})
    for r in pool.run(error_worker, str(d), runs, timeout=240):
        for (name, (_, error, words)), got in zip(cases.items(), r):
            assert got["error"] == error, (name, got)
            assert all(w in got["message"] for w in words), (name, got["message"])
        assert r[4] == {"error": None}, r[4]
        assert r[5]["error"] == "FileNotFoundError" and "model-00001-of-00002" in r[5]["message"], r[5]


# ---------------------------------------------------------------------- Trainer and Fabric
def trainer_worker(rank: int, world: int, cfg: dict) -> dict:
    """Trainer.fit on a LightningModule holding a from_pretrained model, then on one built on the meta
    device and loaded by its owners (PretrainedWeights, or the demo module's empty_init): same losses, weights."""
    from lightning.pytorch import LightningModule, Trainer
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf
    from helpers.lit import TokenData, gather_full
    from helpers.models import lm_loss

    class Lit(LightningModule):
        def __init__(self, meta: bool) -> None:
            super().__init__()
            if meta:
                with mf.meta_init():
                    self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["dir"]))
            else:
                self.model = AutoModelForCausalLM.from_pretrained(cfg["dir"])
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = lm_loss(self.model(batch).logits, batch)
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(TokenData(vocab=VOCAB, seq=SEQ), batch_size=2)

        def configure_optimizers(self) -> Any:
            return mf.Muon(self.parameters(), lr=0.02, adamw_lr=3e-3)

    def fit(module: LightningModule, callbacks: list) -> dict:
        trainer = Trainer(strategy=mf.MatrixFSDPStrategy(wrap_policy=LAYER["llama"], log_plan=False),
                          accelerator="cpu", devices=world, max_steps=3, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          default_root_dir=cfg["root"], callbacks=callbacks)
        trainer.fit(module)
        return {"losses": module.losses, "weights": gather_full(module.model)}

    ref = fit(Lit(meta=False), [])
    ours = fit(Lit(meta=True), [mf.PretrainedWeights(cfg["dir"], prefix="model.")])
    diff = [n for n in ref["weights"] if not torch.equal(ref["weights"][n], ours["weights"][n])]
    # the demo module's empty_init (what a YAML config sets) against its from_pretrained
    from lightning_matrixfsdp.demos import HFCausalLM

    data = [(t[:-1], t[1:]) for t in TokenData(vocab=VOCAB, seq=SEQ + 1)]
    demo = {}
    for empty in (False, True):
        module = HFCausalLM(pretrained=cfg["dir"], empty_init=empty)
        trainer = Trainer(strategy=mf.MatrixFSDPStrategy(wrap_policy=LAYER["llama"], log_plan=False),
                          accelerator="cpu", devices=world, max_steps=3, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          default_root_dir=cfg["root"])
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=2))
        demo[empty] = gather_full(module.model)
    demo_diff = [n for n in demo[False] if not torch.equal(demo[False][n], demo[True][n])]
    return {"ref": ref["losses"], "ours": ours["losses"], "diff": diff, "demo_diff": demo_diff}


def test_trainer_callback_equals_from_pretrained(tmp_path: Path, pool) -> None:
    d = save(tmp_path, "llama", True, tie_word_embeddings=True)
    for r in pool.run(trainer_worker, {"dir": d, "root": str(tmp_path)}, timeout=300):
        assert r["ref"] == r["ours"] and len(r["ours"]) == 3, r
        assert not r["diff"], r["diff"]
        assert not r["demo_diff"], r["demo_diff"]


def fabric_worker(rank: int, world: int, cfg: dict) -> dict:
    """fabric.init_module(empty_init=True) + setup_module + load_pretrained against from_pretrained + setup_module."""
    from lightning.fabric import Fabric
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_matrixfsdp as mf
    from helpers.models import batch_for, lm_loss

    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=mf.MatrixFSDPFabricStrategy(wrap_policy=LAYER["llama"], log_plan=False))
    fabric.launch()
    out = {}
    for way in ("from_pretrained", "empty_init"):
        if way == "empty_init":
            with fabric.init_module(empty_init=True):
                raw = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["dir"]))
            assert all(p.is_meta for p in raw.parameters()) and not any(b.is_meta for b in raw.buffers())
        else:
            raw = AutoModelForCausalLM.from_pretrained(cfg["dir"])
        model = fabric.setup_module(raw)
        if way == "empty_init":
            mf.load_pretrained(raw, cfg["dir"])
        optimizer = fabric.setup_optimizers(mf.Muon(model.parameters(), lr=0.02, adamw_lr=3e-3))
        losses = []
        for step in range(3):
            idx = batch_for(step, rank)
            loss = lm_loss(model(idx).logits, idx)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[way] = (losses, owned(raw))
    (lr, wr), (lo, wo) = out["from_pretrained"], out["empty_init"]
    return {"ref": lr, "ours": lo, "diff": [n for n in wr if not torch.equal(wr[n], wo[n])], "same": set(wr) == set(wo)}


def test_fabric_empty_init_equals_from_pretrained(tmp_path: Path, pool) -> None:
    d = save(tmp_path, "llama", False)  # rotary inv_freq: a buffer no checkpoint holds
    for r in pool.run(fabric_worker, {"dir": d}, timeout=300):
        assert r["ref"] == r["ours"], r
        assert r["same"] and not r["diff"], r
