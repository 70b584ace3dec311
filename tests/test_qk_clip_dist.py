"""QK-Clip across ranks (gloo, float32; scenarios in tests/helpers/qk_scenarios.py):

* the Trainer callback ``QKClip`` gives bitwise the same weights under ``strategy="matrix_fsdp"``
  as under Lightning's ``"ddp"`` (same LightningModule, tiny Llama with GQA and q/k biases, heads
  clipped at every step) and logs its two metrics;
* ``matrix_shard`` + ``QKClipper`` equals the plain reference (every rank's batch recomputed on a
  full copy, SGD, the rule by hand with each head's maximum over all ranks' batches) for a Llama,
  a Qwen3 (q/k norms, owned by one rank) and the demos' GPT, and the Llama under torch's FSDP2;
* with tensor parallelism (data parallel 2 x TP 2: the Llama's attention split by heads, the
  GPT's fused qkv split by rows and gathered) the same, and
  under HSDP (2 replicas x 2, one replica stepping each role: ``replica_split``).

Skipping the maximum over the ranks, or taking a tensor-parallel rank's heads for the first ones,
fails the reference tests (checked by hand).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers.dist import PoolTask  # noqa: E402
from helpers.qk_scenarios import four_ranks, sharded_vs_reference, trainer_pair  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

_SHARDED = PoolTask(sharded_vs_reference, timeout=300)
_FOUR = PoolTask(four_ranks, timeout=300)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt", "fsdp2"])
def test_matrix_shard_equals_the_reference_rule_with_the_maximum_over_ranks(name, hf_pool):
    for rank, r in enumerate(_SHARDED.results(hf_pool)):
        res = r[name]
        first = res["clipped"][0]
        assert 0 < first["clipped"] < first["heads"], (name, first)  # some heads clipped, some not
        assert max(res["diff"]) < 1e-6, (rank, name, res["diff"], res["where"])


@pytest.mark.parametrize("case", ["tp", "tp_gpt", "hsdp"])
def test_tensor_parallel_and_hsdp_equal_the_reference(case, hf_pool4):
    for rank, every in enumerate(_FOUR.results(hf_pool4)):
        r = every[case]
        first = r["clipped"][0]
        assert 0 < first["clipped"] < first["heads"], first
        assert max(r["diff"]) < 2e-6, (rank, r["diff"], r["where"])
        if case == "hsdp":
            assert r["replica_split"], "HSDP ran without replica_split"


def test_trainer_callback_matrix_fsdp_equals_ddp(hf_pool, tmp_path):
    res = hf_pool.run(trainer_pair, str(tmp_path), timeout=300)
    for rank, r in enumerate(res):
        ddp, ours = r["ddp"], r["mf"]
        bad = [n for n in ddp["weights"] if not np.array_equal(ddp["weights"][n], ours["weights"][n])]
        assert not bad, (rank, bad)
        for run in (ddp, ours):
            assert run["logged"] == ["qk_clip/clipped_heads", "qk_clip/max_logit"], run["logged"]
            assert run["clipped"] > 0 and run["detached"]
    # every rank ends with the same weights (the maxima were reduced before each rescale)
    assert all(np.array_equal(res[0]["ddp"]["weights"][n], res[1]["ddp"]["weights"][n]) for n in res[0]["ddp"]["weights"])
