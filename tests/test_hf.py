"""Hugging Face transformers and litgpt models, unmodified, equal DDP Muon bit for bit in float32.

Models are built from tiny configs (no download). The wrap policy is each library's own
decoder-layer class, given as a class or as its dotted import path (docs/huggingface.md).
Every case trains the sharded model and an independent full-replica DDP Muon oracle
(tests/helpers/oracle.py) on 2 gloo processes and compares losses, full gradients and parameters
at every step. Hugging Face models need ``use_cache=False`` under activation
checkpointing; the last test shows what happens without it.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist


LAYER = {  # each library's decoder layer, by import path (what a YAML config would say)
    "llama": "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
    "gpt2": "transformers.models.gpt2.modeling_gpt2.GPT2Block",
    "litgpt": "litgpt.model.Block",
}
PACKAGE = {"llama": "transformers", "gpt2": "transformers", "litgpt": "litgpt"}
VOCAB, SEQ = 64, 16  # what tests/helpers/models.batch_for and tests/helpers/lit.TokenData produce


def build(name: str, **kw: Any) -> torch.nn.Module:
    """A tiny, randomly initialized model of one library (float32, dropout off for exact comparison)."""
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=2 * SEQ, **kw))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw))
    if name == "litgpt":
        from litgpt import GPT, Config

        return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32,
                          **kw))
    raise ValueError(name)


def logits_of(model: torch.nn.Module, idx: torch.Tensor, use_cache: Any = "unset") -> torch.Tensor:
    """Hugging Face models return an output object, litgpt the logits tensor."""
    out = model(idx) if use_cache == "unset" else model(idx, use_cache=use_cache)
    return out if isinstance(out, torch.Tensor) else out.logits


def layer_class(name: str) -> type:
    from lightning_matrixfsdp.runtime.options import check_wrap_policy

    (cls,) = check_wrap_policy(LAYER[name])
    return cls


def tied(model: torch.nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def embeddings_to_adamw(fqn: str, p: torch.nn.Parameter) -> bool:
    """A matrix_filter: the input embedding and the LM head train with AdamW, the other matrices with Muon."""
    return not fqn.endswith(("embed_tokens.weight", "lm_head.weight"))


def _skip_without(name: str) -> None:
    pytest.importorskip(PACKAGE[name])


@pytest.fixture(scope="module")
def pool(hf_pool):
    """The Hugging Face files' two gloo workers (tests/conftest.py): the library imports and the
    Trainer runs stay out of the session's shared pools."""
    return hf_pool


# ---------------------------------------------------------------------- matrix_shard
def shard_worker(rank: int, world: int, cfg: dict) -> dict:
    """matrix_shard(model, wrap_policy=<library layer>) next to the oracle, step by step."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import is_owned
    from helpers.equiv import (EXACT, close, compare, full_params, make_sharded_optimizer, maxdiff,
                               step_oracle_and_sharded)
    from helpers.models import batch_for, lm_loss
    from helpers.oracle import allreduce_mean_grads, oracle_optimizers

    torch.manual_seed(0)
    sharded = build(cfg["model"], **cfg.get("config", {}))
    oracle = copy.deepcopy(sharded)
    sharded.train()
    oracle.train()
    if cfg.get("hf_checkpointing"):  # the library's own activation checkpointing (sets use_cache=False itself)
        sharded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = layer_class(cfg["model"]) if cfg.get("policy_as_class") else LAYER[cfg["model"]]
    mf.matrix_shard(sharded, wrap_policy=policy)
    layers = [m for m in sharded.modules() if isinstance(m, layer_class(cfg["model"]))]
    units = [u.fqn for u in mf.get_plan(sharded).units]
    s_opts = make_sharded_optimizer(sharded, "ours")
    o_opts = oracle_optimizers(oracle)
    losses = []
    for step in range(cfg.get("steps", 4)):
        idx = batch_for(step, rank)
        lo = lm_loss(logits_of(oracle, idx), idx)
        ls = lm_loss(logits_of(sharded, idx), idx)
        assert close(lo.detach(), ls.detach(), EXACT), f"step {step}: loss {ls.item()} vs oracle {lo.item()}"
        losses.append(ls.item())
        lo.backward()
        ls.backward()
        allreduce_mean_grads(oracle)
        o_params = dict(oracle.named_parameters())
        for n, p in sharded.named_parameters():
            if not is_owned(p):
                assert p.grad is None, f"non-owner holds a gradient for {n}"
                continue
            og = o_params[n].grad
            assert p.grad is not None and og is not None, f"{n}: missing gradient"
            assert close(p.grad, og, EXACT), f"step {step}: grad {n} differs by {maxdiff(p.grad, og):.3e}"
        step_oracle_and_sharded(o_opts, s_opts)
        compare(full_params(sharded), dict(oracle.named_parameters()), EXACT, "param", step)
    idx = batch_for(999, rank)
    with torch.no_grad():
        assert close(logits_of(oracle, idx), logits_of(sharded, idx), EXACT), "final logits differ"
    is_tied = tied(sharded) if hasattr(sharded, "get_input_embeddings") else None
    return {"losses": losses, "units": units, "layers": len(layers), "tied": is_tied,
            "n_params": len(list(sharded.parameters()))}


SHARD_CASES = {
    "llama": {"model": "llama"},
    "llama_tied_embeddings": {"model": "llama", "config": {"tie_word_embeddings": True}},
    "llama_policy_as_class": {"model": "llama", "policy_as_class": True},
    "gpt2_tied_conv1d": {"model": "gpt2"},
    "litgpt": {"model": "litgpt"},
    "llama_hf_gradient_checkpointing": {"model": "llama", "hf_checkpointing": True},
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_matrix_shard_equals_ddp_muon(case: str, pool) -> None:
    cfg = SHARD_CASES[case]
    _skip_without(cfg["model"])
    res = pool.run(shard_worker, cfg, timeout=240)
    r = res[0]
    assert r["layers"] == 2 and len(r["units"]) == 3, r["units"]  # one unit per decoder layer + the root
    assert r["losses"][-1] != r["losses"][0], "did not train"
    assert res[0]["losses"] != res[1]["losses"], "ranks saw the same batches"
    if cfg["model"] == "gpt2" or cfg.get("config", {}).get("tie_word_embeddings"):
        assert r["tied"] is True, "the tie between input embedding and LM head was lost"
    elif cfg["model"] == "llama":
        assert r["tied"] is False


# ---------------------------------------------------------------------- Trainer
def trainer_worker(rank: int, world: int, cfg: dict) -> dict:
    """Trainer(strategy=...) on a LightningModule holding the library model; the oracle replays its batches."""
    from lightning.pytorch import LightningModule, Trainer

    import lightning_matrixfsdp as mf
    from helpers.lit import TokenData, gather_full
    from helpers.models import lm_loss
    from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads, oracle_optimizers

    use_cache = cfg.get("use_cache", "unset")

    class LitLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(cfg["model"], **cfg.get("config", {}))
            if cfg.get("hf_checkpointing"):  # the library's own checkpointing instead of the strategy's
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.seen: list[torch.Tensor] = []
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = lm_loss(logits_of(self.model, batch, use_cache), batch)
            self.seen.append(batch.detach().clone())
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(TokenData(vocab=VOCAB, seq=SEQ), batch_size=2)

        def configure_optimizers(self) -> Any:
            a = ADAMW_DEFAULTS
            return mf.Muon(self, adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)

    torch.manual_seed(0)
    lit = LitLM()
    oracle = copy.deepcopy(lit.model)
    strategy: Any = "matrix_fsdp"
    if cfg.get("strategy") is not None:
        strategy = mf.MatrixFSDPStrategy(**cfg["strategy"], log_plan=False)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=cfg.get("steps", 4), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, default_root_dir=cfg["root"],
                      gradient_clip_val=cfg.get("clip"))
    trainer.fit(lit)
    full = gather_full(lit.model)
    units = [u.fqn for u in mf.get_plan(lit).units]
    from lightning_matrixfsdp.runtime.tags import recipe_of

    # what Muon(self) steps with Muon: the recipe recorded on each parameter (explicit options win)
    roles = {n: "matrix" if recipe_of(p).is_matrix else "adamw" for n, p in lit.model.named_parameters()}

    oracle.train()
    keep = cfg.get("strategy", {}).get("matrix_filter")
    opts = oracle_optimizers(oracle, is_matrix=(lambda n, p: p.ndim == 2 and keep(n, p)) if keep else None)
    oracle_losses = []
    for batch in lit.seen:  # no checkpointing in the oracle: recomputation must not change a bit
        loss = lm_loss(logits_of(oracle, batch), batch)
        oracle_losses.append(loss.item())
        loss.backward()
        allreduce_mean_grads(oracle)
        if cfg.get("clip"):
            from helpers.oracle import clip_global_norm

            clip_global_norm(oracle, cfg["clip"])
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    ref = dict(oracle.named_parameters())
    diffs = {n: (full[n].double() - ref[n].detach().double()).abs().max().item() for n in full}
    other = [torch.empty_like(lit.seen[0]) for _ in range(world)]
    dist.all_gather(other, lit.seen[0])
    return {"losses": lit.losses, "oracle_losses": oracle_losses, "param_diff": max(diffs.values()),
            "worst_param": max(diffs, key=diffs.get), "steps": trainer.global_step, "units": units,
            "distinct_batches": not torch.equal(other[0], other[1]), "roles": roles}


TRAINER_CASES = {
    # the registered name: default wrapping (one unit per entry of model.model.layers)
    "llama_tied_registered_name": {"model": "llama", "config": {"tie_word_embeddings": True}},
    # the recipe: the library's layer as wrap and checkpointing policy, use_cache=False in the config
    "llama_checkpointing": {"model": "llama", "config": {"use_cache": False}, "layer_policies": True, "clip": 0.5},
    # use_cache=False given per call instead of in the config
    "gpt2_checkpointing_use_cache_per_call": {"model": "gpt2", "use_cache": False, "layer_policies": True},
    "litgpt_checkpointing": {"model": "litgpt", "layer_policies": True},
    # Hugging Face's own gradient_checkpointing_enable() (it turns the cache off itself)
    "gpt2_hf_gradient_checkpointing": {"model": "gpt2", "hf_checkpointing": True},
    # embeddings and the (tied) head on AdamW: the oracle's Muon gets the other matrices only
    "llama_tied_embeddings_on_adamw": {"model": "llama", "config": {"tie_word_embeddings": True},
                                       "strategy": {"matrix_filter": embeddings_to_adamw}},
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_strategy_equals_ddp_muon(case: str, tmp_path, pool) -> None:
    cfg = dict(TRAINER_CASES[case], root=str(tmp_path))
    _skip_without(cfg["model"])
    if cfg.pop("layer_policies", False):
        cfg["strategy"] = {"wrap_policy": LAYER[cfg["model"]], "activation_checkpointing_policy": {LAYER[cfg["model"]]}}
    res = pool.run(trainer_worker, cfg, timeout=240)
    for r in res:
        assert r["steps"] == 4
        assert r["losses"] == r["oracle_losses"], (r["losses"], r["oracle_losses"])
        assert r["param_diff"] == 0.0, f"{r['worst_param']} differs by {r['param_diff']}"
        assert r["distinct_batches"], "ranks saw the same batches"
        assert len(r["units"]) == 3, r["units"]  # two decoder layers + the root
        matrices = {n for n, role in r["roles"].items() if role == "matrix"}
        if cfg.get("strategy", {}).get("matrix_filter"):
            assert "model.embed_tokens.weight" not in matrices and "model.layers.0.mlp.up_proj.weight" in matrices
        else:
            # the Muon recipe of Muon(self): embeddings (and the head) train with AdamW
            assert {n for n in r["roles"] if n.endswith(("embed_tokens.weight", "wte.weight"))}.isdisjoint(matrices)
    assert res[0]["losses"][-1] != res[0]["losses"][0], "did not train"


# ---------------------------------------------------------------------- use_cache under checkpointing
def kv_cache_worker(rank: int, world: int, use_cache: bool) -> dict:
    """The strategy's checkpointing policy on a Hugging Face layer, with the model's KV cache on or off."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.options import check_checkpointing_policy
    from helpers.models import batch_for, lm_loss
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = build("llama", use_cache=use_cache)
    (cls,) = check_checkpointing_policy(LAYER["llama"])
    for m in model.modules():  # what activation_checkpointing_policy does to each matching layer
        if isinstance(m, cls):
            forward = m.forward
            m.forward = lambda *a, __f=forward, **k: checkpoint(__f, *a, use_reentrant=False, **k)
    mf.matrix_shard(model, wrap_policy=cls)
    idx = batch_for(0, rank)
    out = model(idx)
    cache = out.past_key_values
    result = {"error": None, "cache_after_forward": None if cache is None else cache.get_seq_length()}
    try:
        lm_loss(out.logits, idx).backward()
    except Exception as e:  # noqa: BLE001 - every rank fails in its own recomputation, before any reduction
        result["error"] = f"{type(e).__name__}: {e}"
    result["cache_after_backward"] = None if cache is None else cache.get_seq_length()
    return result


def test_hf_kv_cache_grows_under_checkpointing_and_use_cache_false_avoids_it(pool) -> None:
    """With the cache on, recomputing a layer appends its keys and values a second time. transformers
    4.51-5.3 then fail in torch's checkpoint ("Recomputed values ... have different metadata");
    later releases were seen to pass with the cache doubled. With use_cache=False: no cache, no error."""
    pytest.importorskip("transformers")
    for r in pool.run(kv_cache_worker, True, timeout=240):
        assert r["cache_after_forward"] == SEQ, r
        if r["error"] is not None:
            assert "Recomputed values" in r["error"] and "different metadata" in r["error"], r["error"]
        else:
            assert r["cache_after_backward"] == 2 * SEQ, r  # the recomputation wrote to the cache again
    for r in pool.run(kv_cache_worker, False, timeout=240):
        assert r == {"error": None, "cache_after_forward": None, "cache_after_backward": None}, r


# ---------------------------------------------------------------------- the example and its module
ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^\[matrixfsdp-demo\] step +(\d+)  (train_loss|val_loss) (\S+)$", re.M)


def _run_examples(cwd: Path, *parts: list[str]) -> list[str]:
    """Run example commands as a user would, all in one 2-rank job (tests/helpers/run_examples.py:
    the ranks start once); the output of each part."""
    from conftest import clean_env
    from helpers.run_examples import command, parts as split

    env = clean_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(command(*parts), cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{parts} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "validation_step" not in proc.stderr, "Lightning warned about the validation set-up"
    return split(proc.stdout, len(parts))


def _losses(stdout: str) -> dict[tuple[int, str], float]:
    """One Trainer run's printed losses by (step, name), after checking its optimizer report."""
    report = [json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines() if ln.startswith("[matrixfsdp-demo] {")]
    assert report and report[0]["optimizer"] == "lightning_matrixfsdp.optim.muon.Muon", stdout[-2000:]
    assert report[0]["world_size"] == 2 and report[0]["finite"], report
    return {(int(s), name): float(v) for s, name, v in STEP_LINE.findall(stdout)}


def _same_training(script: dict, cli: dict) -> None:
    """The script's losses at steps 1, 2 and 4 (and validation at 4) fall, and the CLI's equal them."""
    assert sorted(script) == [(1, "train_loss"), (2, "train_loss"), (4, "train_loss"), (4, "val_loss")], script
    assert all(math.isfinite(v) for v in script.values())
    assert script[(4, "train_loss")] < script[(1, "train_loss")], script  # it learns
    shared = set(script) & set(cli)
    assert (4, "train_loss") in shared and (4, "val_loss") in shared, cli
    assert {k: script[k] for k in shared} == {k: cli[k] for k in shared}


def test_finetune_hf_example_script_and_yaml_train_the_same(tmp_path: Path) -> None:
    """The script and the CLI config train the same model (same seed, sizes, policies) to the same losses."""
    pytest.importorskip("transformers")
    script, cli = _run_examples(
        tmp_path, ["script", ROOT / "examples" / "finetune_hf.py", "--max-steps", "4", "--print-every", "2"],
        ["cli", "fit", "--config", ROOT / "examples" / "finetune_hf.yaml", "--trainer.max_steps", "4",
         "--trainer.val_check_interval", "4"])
    _same_training(_losses(script), _losses(cli))
    assert list((tmp_path / "runs" / "finetune_hf").rglob("events.out.tfevents.*"))
    assert list((tmp_path / "runs" / "finetune_hf_cli").rglob("events.out.tfevents.*"))


def test_moe_example_script_and_yaml_train_the_same_with_expert_parallelism(tmp_path: Path) -> None:
    """examples/moe.py (Trainer) and examples/moe.yaml (LightningCLI) train the same tiny Mixtral with
    expert_parallel_size=2 to the same losses; the script's Fabric loop trains it too, moving tokens."""
    pytest.importorskip("transformers")
    script, cli, fabric = _run_examples(
        tmp_path, ["script", ROOT / "examples" / "moe.py", "--max-steps", "4", "--print-every", "2"],
        ["cli", "fit", "--config", ROOT / "examples" / "moe.yaml", "--trainer.max_steps", "4",
         "--trainer.val_check_interval", "4"],
        ["script", ROOT / "examples" / "moe.py", "--fabric", "--max-steps", "3"])
    _same_training(_losses(script), _losses(cli))
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)", fabric, re.M)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), fabric[-2000:]
    traffic = re.search(r"^traffic: (.*)$", fabric, re.M)
    assert traffic and "'ep_dispatch': {'sent': " in traffic.group(1), fabric[-2000:]


def test_hf_module_builds_from_config_or_a_saved_pretrained_directory(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from lightning_matrixfsdp.demos import HFCausalLM

    torch.manual_seed(0)
    built = HFCausalLM(model_type="llama", config={"hidden_size": 32, "intermediate_size": 64,
                                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                                    "tie_word_embeddings": True})
    assert isinstance(built.model, transformers.LlamaForCausalLM)
    assert built.model.config.vocab_size == 256 and built.model.config.use_cache is False
    assert tied(built.model)
    built.model.save_pretrained(tmp_path / "saved")
    loaded = HFCausalLM(pretrained=str(tmp_path / "saved"))
    assert loaded.model.config.use_cache is False and tied(loaded.model)
    want = built.model.state_dict()
    have = loaded.model.state_dict()
    assert set(want) == set(have) and all(torch.equal(want[k], have[k]) for k in want)
    idx = torch.randint(0, 256, (2, 8))
    assert built(idx).shape == (2, 8, 256)
