"""The global-norm clip's all-reduce is communication like any other: it is counted."""
import csv

import torch

import lightning_matrixfsdp as mf
from _dist import run_distributed
from lit import trainer_worker
from models import TinyLM, batch_for, lm_loss


def _clip_counted_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = mf.matrix_shard(TinyLM())
    batch = batch_for(0, rank)
    lm_loss(model(batch), batch).backward()
    before = mf.get_comm_stats(model)["clip"]
    mf.clip_grad_norm_(model, 0.1)
    return {"before": before, "after": mf.get_comm_stats(model)["clip"]}


def test_clip_all_reduce_counts_under_clip(dist_pools):
    for r in dist_pools(2).run(_clip_counted_worker, timeout=120):
        assert r["before"] == {"sent": 0, "recv": 0, "calls": 0}
        # one float64 scalar each way, one call
        assert r["after"] == {"sent": 8, "recv": 8, "calls": 1}, r


def test_strategy_logs_clip_traffic(tmp_path):
    run_distributed(trainer_worker, 2, {"steps": 2, "csv_logger": True, "root": str(tmp_path),
                                         "trainer": {"gradient_clip_val": 0.3, "log_every_n_steps": 1}},
                    timeout=240)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv"))
            if r.get("matrix_fsdp/clip_MB")]
    assert len(rows) == 2, rows
    assert all(float(r["matrix_fsdp/clip_MB"]) == 16 / 2**20 for r in rows), rows
