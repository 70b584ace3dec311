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


# ---------------------------------------------------------------------- every option, every kind of bad value
def _two_args(a, b):  # noqa: ANN001 - a callable of the wrong arity for the one-argument options
    return True


def _one_arg(a):  # noqa: ANN001
    return True


def _no_args():
    return True


# Every option of matrix_shard and both strategies -> values each must refuse at construction,
# naming the option: strings where an enum, a bool or an int is expected, negative and zero sizes,
# booleans and floats for ints, None where it is not allowed, callables of the wrong shape, objects
# of the wrong kind. A new option without a row here fails test_the_bad_value_table_covers_every_option.
BAD_VALUES: dict[str, list] = {
    "wrap_policy": [5, 2.5, True, "Block", "pkg.mod.Block", _no_args, _one_arg, nn.Linear(2, 2), {nn.Linear, 3}],
    "planner": [None, "fastest", "ROLE_GREEDY", 5, True, _one_arg, nn.Linear, nn.Linear(2, 2)],
    "collective": [None, "nccl_magic", "Broadcast", 5, True, _no_args],
    "matrix_filter": [5, "ndim==2", True, nn.Linear, _one_arg, nn.Linear(2, 2)],
    "param_dtype": ["float13", "int32", 16, True, torch.int32, torch.complex64, float],
    "reduce_dtype": ["float13", 16, 2.5, torch.int64, torch.bool],
    "activation_checkpointing_policy": [5, True, "Block", "pkg.mod.Block", _no_args, _two_args, nn.Linear(2, 2)],
    "optimizer": [5, "Muon", True, nn.Linear, nn.Linear(2, 2), _no_args, _two_args,
                  torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)],
    "reshard_after_forward": [None, "no", "False", 1, 0, 2.0],
    "accumulation_no_sync": ["yes", 1, 0.0, "auto"],
    "shard_size": [0, -2, True, False, 2.5, 2.0, "2", "auto", [2]],
    "prefetch": [None, 1, "true", "auto"],
    "zero_missing_grads": [None, 1, "yes"],
    "save_distributed_checkpoint": [None, 1, "dir"],
    "process_group_backend": [5, True, "", "ncll", "auto", "cpu:gloo,cuda:ncll", _no_args],
    "timeout": [60, 60.0, "30m", True, timedelta(0), timedelta(seconds=-1)],
    "tensor_parallel_size": [0, -1, True, 2.0, "2", "all", None],
    "data_parallel_size": [0, -4, False, 1.5, "two", None],
    "log_plan": [None, "false", 0],
    "verify_checkpoints": [None, "yes", 1],
    "reset_changed_roles": [None, "no", 0],
    "replica_split": [None, "yes", "AUTO", 1, 0.0],
    "flatten_conv": [None, "true", 1],
    "broadcast_buffers": [None, "false", 0],
    "ns_steps": [0, -5, True, 5.0, "5", None],
    "async_save": [None, "background", 1],
    "expert_stacks": [5, True, 2.5, [3], {"*.w1": "two"}, {"*.w1": 0}, {"*.w1": [2, 0]}, {3: 2}, _no_args,
                      {"*.w1": {"blocks": 2, "transposed": 1}}, {"*.w1": {"rows": 2}}, {"*.w1": {"interleaved": True}},
                      {"*.w1": {"blocks": [2, 3], "interleaved": True}}],
    "expert_parallel_size": [0, -2, True, 2.0, "2", None],
    "pipeline_parallel_size": [0, -2, True, 2.0, "2", None],
    "pipeline_microbatches": [0, -1, True, 2.5, "4"],
    "pipeline_schedule": ["Bogus", "gpipe", 5, None],
    "pipeline_split": ["blocks.2", 5, [3], [""]],
    "split_stacks": [None, "yes", 1],
    "device": [True, 2.5, "gpu7", "cpu:x", -1, object()],
    "mesh": ["cpu", 2, True, [0, 1], object()],
}


def _options_of(entry) -> set[str]:
    import inspect

    return {n for n in inspect.signature(entry).parameters if n not in ("module", "config")}


ENTRIES = {"matrix_shard": mf.matrix_shard, "MatrixFSDPStrategy": mf.MatrixFSDPStrategy,
           "MatrixFSDPFabricStrategy": mf.MatrixFSDPFabricStrategy}


def test_the_bad_value_table_covers_every_option():
    every = set().union(*(_options_of(e) for e in ENTRIES.values()))
    assert every - set(BAD_VALUES) == set(), f"options without bad values in BAD_VALUES: {every - set(BAD_VALUES)}"
    assert set(BAD_VALUES) - every == set(), f"rows for options that no entry point takes: {set(BAD_VALUES) - every}"


def _construct(entry_name: str, option: str, value):
    entry = ENTRIES[entry_name]
    if entry_name == "matrix_shard":
        return lambda: entry(TinyLM(layers=1), **{option: value})
    return lambda: entry(**{option: value})


PAIRS = [(e, o) for e in ENTRIES for o in sorted(BAD_VALUES) if o in _options_of(ENTRIES[e])]


@pytest.mark.parametrize("entry_name,option", PAIRS, ids=[f"{e}-{o}" for e, o in PAIRS])
def test_every_bad_value_is_refused_at_construction_naming_the_option(entry_name, option):
    """Before: optimizer= took a zero-argument callable, an nn.Module class or instance (all
    failing at setup), process_group_backend= any non-empty string ('ncll', 'auto'), and
    tensor_parallel_size= refused numpy ints that shard_size= takes."""
    for value in BAD_VALUES[option]:
        with pytest.raises(mf.MatrixShardError) as info:
            _construct(entry_name, option, value)()
        msg = str(info.value)
        assert isinstance(info.value, ValueError)
        assert msg.startswith(f"{option}=") or f" {option}=" in msg or f"({option}=" in msg, (value, msg)
        if not callable(value) and len(repr(value)) < 40:
            assert repr(value) in msg, (value, msg)


def test_parallel_sizes_take_integer_like_values_as_shard_size_does():
    import numpy as np

    s = mf.MatrixFSDPStrategy(tensor_parallel_size=np.int64(2), data_parallel_size=np.int32(1),
                              shard_size=np.int64(1))
    c = s.config
    assert (c.tensor_parallel_size, c.data_parallel_size, c.shard_size) == (2, 1, 1)
    assert all(type(v) is int for v in (c.tensor_parallel_size, c.data_parallel_size, c.shard_size))
