"""Every option of matrix_shard and MatrixFSDPStrategy is checked where it is given.

A wrong option raises MatrixShardError (a ValueError) naming the option, the value
given and what is accepted: ``matrix_shard`` before it touches the model, the
strategy at construction (not at setup). The accepted forms of the module policies
(a bare class, a dotted import path, a set or list of either, a callable) shard the
model into the expected units and train exactly like the unsharded oracle.
"""
from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
from torch import nn

import lightning_matrixfsdp as mf
from helpers.equiv import make_sharded_optimizer
from helpers.models import Block, TinyLM, batch_for, lm_loss
from helpers.oracle import oracle_optimizers


def _refused(call, option: str, value_repr: str) -> str:
    with pytest.raises(mf.MatrixShardError) as info:
        call()
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert f"{option}={value_repr}" in msg, msg
    return msg


# ---------------------------------------------------------------------- the cases
SHARD_BAD = [
    # (option, value, repr that must appear, a fragment saying what is accepted or why)
    ("wrap_policy", 5, "5", "a callable (name, module) -> bool"),
    ("wrap_policy", "pkg.mod.Block", "'pkg.mod.Block'", "No module named 'pkg'"),
    ("wrap_policy", "Block", "'Block'", "dotted import path"),
    ("wrap_policy", "torch.nn.functional.relu", "'torch.nn.functional.relu'", "not an nn.Module class"),
    ("wrap_policy", {nn.Linear, 3}, None, "3 (int) is not an nn.Module class"),
    ("wrap_policy", nn.Linear(2, 2), None, "give its class"),
    ("wrap_policy", (lambda module: True), None, "cannot be called as (name, module)"),
    ("matrix_filter", 5, "5", "a callable (fqn, param) -> bool"),
    ("matrix_filter", nn.Linear, None, "a class"),
    ("matrix_filter", (lambda p: True), None, "cannot be called as (fqn, param)"),
    ("param_dtype", torch.int32, "torch.int32", "not a floating dtype"),
    ("param_dtype", torch.complex64, "torch.complex64", "not a floating dtype"),
    ("reduce_dtype", "float13", "'float13'", "not a dtype"),
    ("reduce_dtype", 16, "16", "'bf16'"),
    # the other options
    ("planner", "fastest", "'fastest'", "role_greedy"),
    ("planner", 5, "5", "a callable (units, world) -> Plan"),
    ("collective", "nccl_magic", "'nccl_magic'", "p2p"),
    ("collective", 5, "5", "'broadcast'"),
    ("reshard_after_forward", "no", "'no'", "True or False"),
    ("prefetch", 1, "1", "True or False"),
    ("zero_missing_grads", None, "None", "True or False"),
    ("ns_steps", 0, "0", "at least 1"),
    ("ns_steps", 2.5, "2.5", "a positive int"),
    ("shard_size", 0, "0", "at least 1"),
    ("shard_size", "2", "'2'", "a positive int"),
    ("shard_size", True, "True", "a positive int"),
    ("device", "gpu7", "'gpu7'", "device string"),
    ("mesh", "cpu", "'cpu'", "DeviceMesh"),
]


def _ids(cases):
    return [f"{c[0]}={c[1]!r}"[:40] for c in cases]


@pytest.mark.parametrize("option,value,shown,accepted", SHARD_BAD, ids=_ids(SHARD_BAD))
def test_matrix_shard_refuses_a_bad_option_before_touching_the_model(option, value, shown, accepted):
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    msg = _refused(lambda: mf.matrix_shard(model, **{option: value}), option, shown or repr(value)[:40])
    assert accepted in msg, msg
    assert not mf.is_matrix_sharded(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mf.matrix_shard(model)  # the model is still usable: nothing was half-applied


STRATEGY_ONLY_BAD = [
    ("activation_checkpointing_policy", 5, "5", "a callable (module) -> bool"),
    ("activation_checkpointing_policy", "pkg.mod.Block", "'pkg.mod.Block'", "No module named 'pkg'"),
    ("activation_checkpointing_policy", (lambda name, module: True), None, "cannot be called as (module)"),
    ("optimizer", 5, "5", "callable params -> Optimizer"),
    ("optimizer", torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), None, "an optimizer instance"),
    ("accumulation_no_sync", "yes", "'yes'", "True or False"),
    ("save_distributed_checkpoint", 1, "1", "True or False"),
    ("log_plan", "false", "'false'", "True or False"),
    ("timeout", 60, "60", "timedelta"),
    ("timeout", timedelta(0), "datetime.timedelta(0)", "positive"),
    ("process_group_backend", 5, "5", "'gloo'"),
    ("tensor_parallel_size", "two", "'two'", "positive int or \"auto\""),
    ("data_parallel_size", 0, "0", "positive int or \"auto\""),
]
STRATEGY_BAD = [c for c in SHARD_BAD if c[0] not in ("ns_steps", "device", "mesh")] + STRATEGY_ONLY_BAD


@pytest.mark.parametrize("option,value,shown,accepted", STRATEGY_BAD, ids=_ids(STRATEGY_BAD))
def test_strategy_refuses_a_bad_option_at_construction(option, value, shown, accepted):
    msg = _refused(lambda: mf.MatrixFSDPStrategy(**{option: value}), option, shown or repr(value)[:40])
    assert accepted in msg, msg


def test_mesh_and_shard_size_together_are_refused():
    with pytest.raises(mf.MatrixShardError, match="either mesh or shard_size"):
        mf.matrix_shard(TinyLM(), mesh=object(), shard_size=2)


# ---------------------------------------------------------------------- accepted forms
def _units_of(model: nn.Module, classes: tuple[type, ...]) -> set[str]:
    """The independent expectation: every named module of those classes (with parameters), plus the root."""
    return {n for n, m in model.named_modules() if n and isinstance(m, classes)} | {""}


ACCEPTED_WRAP = {
    "a bare class": Block,
    "a dotted path": "helpers.models.Block",
    "a set of classes": {Block},
    "a list of dotted paths": ["helpers.models.Block"],
    "a tuple mixing both": (Block, "helpers.models.Block"),
    "a frozenset": frozenset({Block}),
    "a callable": (lambda name, module: isinstance(module, Block)),
    "a bare library class": nn.Linear,
    "a library dotted path": "torch.nn.Linear",
}


@pytest.mark.parametrize("form", list(ACCEPTED_WRAP), ids=list(ACCEPTED_WRAP))
def test_accepted_wrap_policy_forms_shard_and_train_like_the_oracle(form):
    policy = ACCEPTED_WRAP[form]
    torch.manual_seed(0)
    plain = TinyLM()
    ref = copy.deepcopy(plain)
    classes = (nn.Linear,) if form.startswith("a bare library") or form.startswith("a library") else (Block,)

    sharded = mf.matrix_shard(plain, wrap_policy=policy, param_dtype="fp32", reduce_dtype=torch.float32)
    assert {u.fqn for u in mf.get_plan(sharded).units} == _units_of(ref, classes)

    ours = make_sharded_optimizer(sharded, "ours")
    oracle = oracle_optimizers(ref)
    for step in range(2):
        idx = batch_for(step, 0)
        for model, opts in ((sharded, ours), (ref, oracle)):
            lm_loss(model(idx), idx).backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
    for name, p in ref.named_parameters():
        assert torch.equal(dict(sharded.named_parameters())[name].data, p.data), name


@pytest.mark.parametrize("form", ["a bare class", "a dotted path", "a set of classes", "a list of dotted paths"])
def test_strategy_normalizes_policies_to_a_set_of_classes(form):
    s = mf.MatrixFSDPStrategy(wrap_policy=ACCEPTED_WRAP[form], activation_checkpointing_policy=ACCEPTED_WRAP[form])
    assert s.wrap_policy == {Block} and s.activation_checkpointing_policy == {Block}


def test_strategy_keeps_the_other_accepted_forms():
    pick = lambda module: isinstance(module, Block)  # noqa: E731
    s = mf.MatrixFSDPStrategy(
        wrap_policy=None, activation_checkpointing_policy=pick, param_dtype="bf16", reduce_dtype=torch.float32,
        planner="cost_aware", collective="broadcast", shard_size=2, optimizer=torch.optim.AdamW,
        timeout=timedelta(minutes=5), process_group_backend="gloo")
    assert s.wrap_policy is None and s.activation_checkpointing_policy is pick
    assert s.param_dtype is torch.bfloat16 and s.reduce_dtype is torch.float32
    assert (s.planner, s.collective, s.shard_size, s.optimizer_factory) == ("cost_aware", "broadcast", 2,
                                                                            torch.optim.AdamW)
