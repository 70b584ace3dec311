"""``MatrixFSDPConfig``: the one options object of matrix_shard and both strategies.

The ``config=`` form means exactly what the keyword form means; both together are
refused; a wrong value is refused when the config is built, with the keyword form's
message; the config is frozen (and hashable); the keyword signatures are generated from
it, so every option has one list.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.runtime.config import ADAPTER, SHARD, MatrixFSDPConfig
from helpers.models import Block, TinyLM

OPTIONS = dict(wrap_policy="helpers.models.Block", planner="scope_greedy", collective="broadcast", param_dtype="bf16",
               reduce_dtype="fp32", reshard_after_forward=False, prefetch=False, zero_missing_grads=True,
               flatten_conv=True, broadcast_buffers=False, replica_split=True)


@pytest.mark.parametrize("cls", [mf.MatrixFSDPStrategy, mf.MatrixFSDPFabricStrategy])
def test_config_form_equals_keyword_form(cls):
    extra = dict(activation_checkpointing_policy=[Block], optimizer=torch.optim.AdamW, accumulation_no_sync=True,
                 shard_size=2, log_plan=False, verify_checkpoints=False, reset_changed_roles=True)
    by_keywords = cls(**OPTIONS, **extra)
    by_config = cls(config=MatrixFSDPConfig(**OPTIONS, **extra))
    assert by_keywords.config == by_config.config
    assert by_keywords.config.wrap_policy == {Block} and by_keywords.config.param_dtype is torch.bfloat16
    for name in MatrixFSDPConfig.names(ADAPTER):  # the attributes read the same config
        attr = "optimizer_factory" if name == "optimizer" else name
        if name not in ("process_group_backend",):
            assert getattr(by_keywords, attr) == getattr(by_config, attr), name
    # positional options still bind in the documented order
    assert cls(None, "cost_aware").config == MatrixFSDPConfig(planner="cost_aware")


def test_accumulation_no_sync_default_is_each_strategys_own():
    assert mf.MatrixFSDPStrategy().accumulation_no_sync is False
    assert mf.MatrixFSDPFabricStrategy().accumulation_no_sync is True
    assert mf.MatrixFSDPFabricStrategy(config=MatrixFSDPConfig()).accumulation_no_sync is True
    assert mf.MatrixFSDPFabricStrategy(accumulation_no_sync=False).accumulation_no_sync is False


def test_matrix_shard_config_form_equals_keyword_form():
    torch.manual_seed(0)
    a, b = TinyLM(), TinyLM()
    b.load_state_dict(a.state_dict())
    shard_options = {k: v for k, v in OPTIONS.items() if k != "flatten_conv"}
    mf.matrix_shard(a, **shard_options, ns_steps=3)
    mf.matrix_shard(b, config=MatrixFSDPConfig(**shard_options, ns_steps=3))
    assert mf.get_plan(a).to_dict() == mf.get_plan(b).to_dict()
    assert mf.get_plan(b).options["ns_steps"] == 3


@pytest.mark.parametrize("call", [
    lambda c: mf.MatrixFSDPStrategy(config=c, planner="cost_aware"),
    lambda c: mf.MatrixFSDPFabricStrategy(config=c, prefetch=False),
    lambda c: mf.matrix_shard(TinyLM(), config=c, collective="broadcast"),
], ids=["trainer", "fabric", "matrix_shard"])
def test_config_and_keywords_together_are_refused(call):
    with pytest.raises(TypeError, match="either as config=MatrixFSDPConfig"):
        call(MatrixFSDPConfig())


def test_config_of_another_type_is_refused():
    with pytest.raises(TypeError, match="takes a MatrixFSDPConfig, got dict"):
        mf.MatrixFSDPStrategy(config={"planner": "cost_aware"})


@pytest.mark.parametrize("option,value,shown", [
    ("planner", "fastest", "planner='fastest'"),
    ("collective", "nccl_magic", "collective='nccl_magic'"),
    ("param_dtype", torch.int32, "param_dtype=torch.int32"),
    ("wrap_policy", "Block", "wrap_policy='Block'"),
    ("optimizer", 5, "optimizer=5"),
    ("timeout", 60, "timeout=60"),
    ("tensor_parallel_size", 0, "tensor_parallel_size=0"),
    ("ns_steps", 0, "ns_steps=0"),
])
def test_a_bad_value_is_refused_at_construction_with_the_keyword_message(option, value, shown):
    with pytest.raises(mf.MatrixShardError) as at_config:
        MatrixFSDPConfig(**{option: value})
    assert shown in str(at_config.value)
    keyword_form = mf.matrix_shard if option == "ns_steps" else mf.MatrixFSDPStrategy
    args = (TinyLM(),) if option == "ns_steps" else ()
    with pytest.raises(mf.MatrixShardError) as at_keyword:
        keyword_form(*args, **{option: value})
    assert str(at_config.value) == str(at_keyword.value)


def test_config_is_frozen_and_hashable():
    config = MatrixFSDPConfig(wrap_policy=[Block, "helpers.models.Block"], planner="cost_aware")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.planner = "role_greedy"  # type: ignore[misc]
    assert isinstance(config.wrap_policy, frozenset)  # a policy set cannot be changed in place either
    assert hash(config) == hash(MatrixFSDPConfig(wrap_policy={Block}, planner="cost_aware"))
    changed = config.updated(planner="scope_greedy")
    assert (config.planner, changed.planner, changed.wrap_policy) == ("cost_aware", "scope_greedy", {Block})
    with pytest.raises(mf.MatrixShardError, match="planner='fastest'"):
        config.updated(planner="fastest")  # a copy is checked too


def test_signatures_are_generated_from_the_one_option_list():
    fields = [f.name for f in dataclasses.fields(MatrixFSDPConfig)]
    strategy = list(inspect.signature(mf.MatrixFSDPStrategy).parameters)
    fabric = list(inspect.signature(mf.MatrixFSDPFabricStrategy).parameters)
    shard = list(inspect.signature(mf.matrix_shard).parameters)
    assert strategy == fabric == [n for n in fields if n != "ns_steps"] + ["config"]
    assert shard == ["module", "mesh", "device"] + list(MatrixFSDPConfig.names(SHARD)) + ["config"]
    assert "optimizer" not in MatrixFSDPConfig.names(SHARD) and "ns_steps" not in MatrixFSDPConfig.names(ADAPTER)
    with pytest.raises(TypeError, match="unexpected keyword argument 'optimizer'"):
        mf.matrix_shard(nn.Linear(2, 2), optimizer=torch.optim.AdamW)
