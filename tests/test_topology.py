"""``collective="auto"`` / ``replica_split="auto"`` (issue 22): the pure rule, the choice on every
rank with node boundaries simulated by ``LOCAL_WORLD_SIZE``, results against the DDP oracle for
each choice, and inconsistent topologies refused on every rank (no hang)."""
import os
from unittest import mock

import pytest
import torch

import lightning_matrixfsdp as mf
from helpers.equiv import equivalence_worker
from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
from lightning_matrixfsdp.runtime.mesh.topology import RankPlace, TopologyError, choose, node_ids

STEPS = 2


# ---------------------------------------------------------------- the pure rule
def test_node_ids_from_local_world_size_and_from_hosts():
    lws = [RankPlace(r, "h", 2, r // 2, 4) for r in range(4)]
    assert node_ids(lws) == {0: 0, 1: 0, 2: 1, 3: 1}
    hosts = [RankPlace(r, h) for r, h in enumerate(["b", "b", "a", "a"])]
    assert node_ids(hosts) == {0: 0, 1: 0, 2: 1, 3: 1}


@pytest.mark.parametrize("places,match", [
    ([RankPlace(0, "h", 2, None, 2), RankPlace(1, "h", None, None, 2)], "set on some ranks"),
    ([RankPlace(0, "h", 2, None, 2), RankPlace(1, "h", 1, None, 2)], "differs between ranks"),
    ([RankPlace(0, "h", 2, 0, 2), RankPlace(1, "h", 2, 1, 2)], "GROUP_RANK=1"),
    ([RankPlace(0, "a", 2, None, 2), RankPlace(1, "b", 2, None, 2)], "cannot span two hosts"),
    ([RankPlace(0, "h", 2, None, 3), RankPlace(1, "h", 2, None, 3)], "does not divide the world"),
])
def test_contradicting_reports_are_refused(places, match):
    with pytest.raises(TopologyError, match=match):
        node_ids(places)


def test_choose_rule_and_explicit_values():
    inside, across = {0: 0, 1: 0, 2: 1, 3: 1}, {0: 0, 1: 1}
    def pair(c):
        return c.collective, c.replica_split

    assert pair(choose("auto", "auto", [0, 1], inside, 2)) == ("p2p", True)
    assert pair(choose("auto", "auto", [0, 1, 2, 3], inside, 1)) == ("broadcast", False)
    assert choose("auto", "auto", [0, 1], across, 1).collective == "broadcast"
    assert pair(choose("auto", "auto", [3], None, 4)) == ("p2p", True)
    explicit = choose("padded_all_gather", False, [0, 1], None, 2)
    assert pair(explicit) == ("padded_all_gather", False) and explicit.collective_reason == "explicit"


def test_config_defaults_and_checks():
    c = MatrixFSDPConfig()
    assert (c.collective, c.replica_split) == ("auto", "auto")
    assert MatrixFSDPConfig(collective="broadcast", replica_split=True).replica_split is True
    with pytest.raises(mf.MatrixShardError, match="replica_split"):
        MatrixFSDPConfig(replica_split="on")


# ---------------------------------------------------------------- on gloo workers
def _with_env(env: dict, fn, *args):
    """Run ``fn`` with ``env`` set in this (pooled, reused) worker, then restore it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items() if v is not None})
    for k in [k for k, v in env.items() if v is None]:
        os.environ.pop(k, None)
    try:
        return fn(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _equiv_worker(rank, world, env, cfg):
    return _with_env(env, equivalence_worker, rank, world, cfg)


def _shard_worker(rank, world, env, kw, hosts=None):
    env = {k: (v[rank] if isinstance(v, list) else v) for k, v in env.items()}  # a list: one value per rank

    def go():
        if hosts is not None:  # this rank's host name as the gather sees it (socket.gethostname)
            with mock.patch("socket.gethostname", return_value=hosts[rank]):
                return run()
        return run()

    def run():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        try:
            mf.matrix_shard(model, **kw)
        except mf.MatrixShardError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        plan = mf.get_plan(model)
        return {"collective": plan.options["collective"], "split": plan.replica_split, "text": str(plan)}
    return _with_env(env, go)


def _choice(r):
    return r["plan_dict"]["options"]["collective"], r["plan_dict"]["options"]["collective_reason"]


def test_four_ranks_two_simulated_nodes_choose_broadcast_and_match_the_oracle(dist_pools):
    # the shard group (the world) spans the two simulated nodes: broadcast on every rank, same reason
    # float64 and 1e-9, as the explicit broadcast runs of test_runtime_equivalence at world 3 (the
    # broadcast's gradient reduction adds in another order than the oracle's flat sum)
    res = dist_pools(4).run(_equiv_worker, {"LOCAL_WORLD_SIZE": 2}, {"steps": STEPS, "collective": "auto",
                                                                      "replica_split": "auto", "dtype": torch.float64})
    assert {_choice(r) for r in res} == {_choice(res[0])} and _choice(res[0])[0] == "broadcast"
    assert "spans 2 nodes" in _choice(res[0])[1]
    for r in res:  # the worker asserted each step within equiv.FLOAT64; say it again here
        assert r["worst"]["grad"] <= 1e-9 and r["worst"]["param"] <= 1e-9, r["worst"]
        assert r["stats"]["materialize"]["calls"] > 0


def test_two_ranks_one_node_choose_p2p_and_match_the_oracle_exactly(dist_pools):
    res = dist_pools(2).run(_equiv_worker, {"LOCAL_WORLD_SIZE": None}, {"steps": STEPS, "collective": "auto"})
    assert [_choice(r)[0] for r in res] == ["p2p", "p2p"] and "inside node 0" in _choice(res[0])[1]
    for r in res:
        assert r["worst"] == {"loss": 0.0, "grad": 0.0, "param": 0.0, "logits": 0.0}, r["worst"]


def test_hsdp_shard_groups_inside_nodes_choose_p2p_and_the_split(dist_pools):
    # 2 simulated nodes x 2, shard_size=2: each shard group inside a node; replicas -> replica_split on
    res = dist_pools(4).run(_shard_worker, {"LOCAL_WORLD_SIZE": 2}, {"shard_size": 2})
    assert [(r["collective"], r["split"]) for r in res] == [("p2p", True)] * 4, res
    assert "collective: p2p (auto: the shard group (2 ranks) lies inside node" in res[0]["text"]


def test_host_names_decide_without_local_world_size(dist_pools):
    res = dist_pools(4).run(_shard_worker, {"LOCAL_WORLD_SIZE": None}, {}, ["a", "a", "b", "b"])
    assert [(r["collective"], r["split"]) for r in res] == [("broadcast", False)] * 4, res


@pytest.mark.parametrize("env,kw,hosts,match", [
    ({"LOCAL_WORLD_SIZE": 3}, {}, None, "does not divide the world size 4"),
    ({"LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 0}, {}, None, "GROUP_RANK=0"),  # ranks 2, 3 claim node 0
    ({"LOCAL_WORLD_SIZE": 2}, {}, ["a", "b", "b", "b"], "cannot span two hosts"),  # LWS vs the host gather
    # nodes of 3 and 1 ranks: shard group {0, 1} inside a node, {2, 3} across; every replica refuses
    ({"LOCAL_WORLD_SIZE": None}, {"shard_size": 2}, ["a", "a", "a", "b"], "chose different collectives"),
    # one rank's launcher variable is garbage: it must not raise alone while the others gather
    ({"LOCAL_WORLD_SIZE": ["two", 2, 2, 2]}, {}, None, "LOCAL_WORLD_SIZE='two' is not an integer"),
], ids=["lws-3-of-4", "group-rank", "lws-vs-hosts", "uneven-nodes-hsdp", "one-rank-bad-lws"])
def test_inconsistent_topology_fails_on_every_rank(env, kw, hosts, match, dist_pools):
    res = dist_pools(4).run(_shard_worker, env, kw, hosts, timeout=60)
    assert all("error" in r and match in r["error"] for r in res), res
