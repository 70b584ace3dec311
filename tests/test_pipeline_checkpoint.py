"""Checkpoints under pipeline parallelism keep the whole model's names (issue 38 item 5).

A PP=2 x DP=2 run (4 gloo processes, demo GPT) saves a directory, a consolidated file and an
asynchronous directory. The oracle is the saving run's own whole weights and optimizer state,
gathered from the owners by name in the test helpers: the directory resumes at PP=2 x DP=2
bitwise (one more step equals not stopping), and loads at PP=1 x DP=4, at PP=4, and in one
process (consolidated file, safetensors export, a plain unsharded model) with every weight and
every per-parameter optimizer state (Muon's momentum, AdamW's moments) bitwise equal. Bad inputs
are refused on every rank: a checkpoint that lacks a stage's keys, stages that disagree on the keys.
"""
from __future__ import annotations

import pytest
import torch

from helpers.pipeline_ckpt_scenarios import load_at, pretrained_into_stages, save_and_resume, save_rogue

WORLD = 4


def _ok(res: list) -> list:
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('trace', '')}"
    return res


def _merged(res: list, key: str) -> dict:
    out: dict = {}
    for r in res:
        out.update(r[key])
    return out


def _equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))[:6]}"
    for k, v in want.items():
        if isinstance(v, dict):
            _equal(got[k], v, f"{what} {k}")
        else:
            assert torch.equal(got[k], v), f"{what}: {k} differs by {(got[k] - v).abs().max().item():.3e}"


@pytest.fixture(scope="module")
def saved(dist_pools, tmp_path_factory):
    base = tmp_path_factory.mktemp("ppckpt")
    case = {"dir": str(base / "ck"), "file": str(base / "ck.ckpt"), "async": str(base / "ck_async")}
    res = _ok(dist_pools(WORLD).run(save_and_resume, case, timeout=400))
    return case, res, _merged(res, "weights"), _merged(res, "state")


def test_resume_at_the_same_layout_is_bitwise(saved):
    case, res, weights, state = saved
    from helpers.pipeline_scenarios import demo_gpt

    assert sorted(weights) == sorted(n for n, _ in demo_gpt().named_parameters())  # every stage's, by global name
    for rank, r in enumerate(res):
        _equal(r["loaded"], r["weights"], f"rank {rank} loaded weights")
        _equal(r["loaded_state"], r["state"], f"rank {rank} loaded optimizer state")
        _equal(r["resumed"], r["after"], f"rank {rank} one step after resuming")


def test_the_sidecar_lists_every_stage(saved):
    case, _, weights, _ = saved
    from lightning_matrixfsdp.checkpoint import read_sidecar

    side = read_sidecar(case["dir"])
    assert set(weights) <= set(side["params"]), sorted(set(weights) - set(side["params"]))[:5]
    assert side["mesh"] == {"data_parallel": 2, "tensor_parallel": 1, "pipeline_parallel": 2}
    groups = [k for g in side["optimizers"][0]["param_groups"] for k in g]
    assert sorted(groups) == sorted(weights)  # every stage's parameters in the param groups


@pytest.mark.parametrize("pp", [1, 4])
def test_load_at_another_pipeline_size(saved, dist_pools, pp):
    case, _, weights, state = saved
    res = _ok(dist_pools(WORLD).run(load_at, {"dir": case["dir"], "pp": pp}, timeout=400))
    _equal(_merged(res, "weights"), weights, f"PP={pp} weights")
    _equal(_merged(res, "state"), state, f"PP={pp} optimizer state")


def test_one_process_file_export_and_plain_model(saved, tmp_path):
    case, _, weights, state = saved
    from lightning_matrixfsdp.checkpoint import load_weights
    from lightning_matrixfsdp.checkpoint.consolidate import dcp_to_file
    from lightning_matrixfsdp.checkpoint.export import export_safetensors
    from safetensors.torch import load_file

    from helpers.pipeline_scenarios import demo_gpt

    dcp_to_file(case["dir"] and __import__("pathlib").Path(case["dir"]), tmp_path / "one.ckpt")
    for path in (tmp_path / "one.ckpt", case["file"]):  # consolidated offline, and saved as a file at PP=2
        ck = torch.load(path, map_location="cpu", weights_only=False)
        _equal({k: v for k, v in ck["state_dict"].items() if k in weights}, weights, f"{path} weights")
        native = ck["optimizer_states"][0]
        names = [n for g in native["param_groups"] for n in g["param_names"]]
        ids = [i for g in native["param_groups"] for i in g["params"]]
        got = {names[ids.index(i)]: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)}
               for i, s in native["state"].items()}
        _equal(got, state, f"{path} optimizer state")
    export_safetensors(case["dir"], tmp_path / "hf")
    _equal({k: v for k, v in load_file(tmp_path / "hf" / "model.safetensors").items() if k in weights}, weights,
           "safetensors")
    plain = demo_gpt()
    load_weights(plain, case["dir"])
    _equal({k: v.detach() for k, v in plain.named_parameters()}, weights, "plain model")


def test_async_save_is_the_same_checkpoint(saved, dist_pools):
    case, _, weights, state = saved
    res = _ok(dist_pools(WORLD).run(load_at, {"dir": case["async"], "pp": 1}, timeout=400))
    _equal(_merged(res, "weights"), weights, "async weights")
    _equal(_merged(res, "state"), state, "async optimizer state")


def test_a_checkpoint_without_a_stage_is_refused_on_every_rank(saved, dist_pools, tmp_path):
    case, _, weights, _ = saved
    from lightning_matrixfsdp.checkpoint.consolidate import dcp_to_file, file_to_dcp
    from pathlib import Path

    dcp_to_file(Path(case["dir"]), tmp_path / "one.ckpt", weights_only=True)
    sd = torch.load(tmp_path / "one.ckpt", weights_only=True)
    sd = {k: v for k, v in sd.get("state_dict", sd).items() if not k.startswith(("blocks.3", "head", "ln_f"))}
    torch.save(sd, tmp_path / "partial.pt")
    file_to_dcp(tmp_path / "partial.pt", tmp_path / "partial")
    res = dist_pools(WORLD).run(load_at, {"dir": str(tmp_path / "partial"), "pp": 2, "optimizers": False},
                                timeout=400)
    for rank, r in enumerate(res):
        assert "CheckpointKeyError" in r.get("error", ""), f"rank {rank}: {r}"
        assert "missing keys" in r["error"] and "pipeline stage(s) 1" in r["error"], r["error"]


def test_stages_that_disagree_on_the_keys_are_refused_on_every_rank(dist_pools, tmp_path):
    res = dist_pools(WORLD).run(save_rogue, {"dir": str(tmp_path / "rogue")}, timeout=400)
    for rank, r in enumerate(res):
        assert "disagree on the model's keys" in r.get("error", ""), f"rank {rank}: {r}"
        assert "rogue" in r["error"]


def test_pretrained_weights_go_straight_to_each_stage(saved, dist_pools, tmp_path):
    """A safetensors file read into PP=2 x DP=2 stages: each rank reads its own stage's tensors only."""
    case, _, weights, _ = saved
    from lightning_matrixfsdp.checkpoint.export import export_safetensors

    export_safetensors(case["dir"], tmp_path / "hf")
    res = _ok(dist_pools(WORLD).run(pretrained_into_stages, {"file": str(tmp_path / "hf" / "model.safetensors"),
                                                             "pp": 2}, timeout=400))
    _equal(_merged(res, "weights"), weights, "pretrained weights")
    for rank, r in enumerate(res):
        assert r["read"] and not r["foreign"], f"rank {rank} read another stage's tensors: {r['foreign'][:5]}"
