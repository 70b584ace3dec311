"""Pipeline parallelism: the stages' key indexes joined, so a checkpoint keeps the whole model's names.

Under pipeline parallelism each rank holds the tensors of its stages only (``views/checkpoint``:
the stages are the sharded roots, keyed by the whole model's names; the other stages' keys are
``elsewhere``). A checkpoint still describes the whole model: its sidecar lists every stage's
tensors, its optimizer param groups every stage's parameters, a consolidated file every tensor,
and a load checks each stage strictly against its own keys while the other stages' keys are
expected. :func:`join_stages` tells every rank what the other stages hold, from one gather of
small records, and refuses a run whose ranks do not agree on the model's keys (every rank
raises the same error: they all judge the same gathered records).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from lightning_matrixfsdp.checkpoint.agree import all_gather_object, world
from lightning_matrixfsdp.checkpoint.errors import CheckpointError

__all__ = ["Remote", "join_stages"]


@dataclass(frozen=True, kw_only=True)
class Remote:
    """A tensor of the model that another pipeline stage holds, as that stage describes it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    primary: str
    role: Optional[str]
    owner: Optional[int]            # shard-group rank of its owner (None: replicated within its stage)
    stages: tuple[int, ...]         # the pipeline stages of the rank that described it
    layout: Optional[dict[str, Any]] = None  # held in chunks (tensor or expert parallelism): the cut


def _listing(keys: Sequence[str], limit: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(repr(k) for k in keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def join_stages(model_keys: Sequence[str], described: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any],
                stages: Sequence[int], plans: Sequence[Mapping[str, Any]] = ()
                ) -> tuple[dict[str, Remote], dict[str, Any], dict[str, int], list[dict[str, Any]]]:
    """(the tensors other stages hold, their non-tensor state, key -> lowest global rank holding
    its data, every stage's plan record in stage order) from every rank's ``described`` entries.
    Collective on the checkpoint group.

    ``model_keys``: the whole model's ``state_dict`` keys as this rank sees them (every stage's);
    ``described``: this rank's entries (``index._described``); ``extra``: its non-tensor state;
    ``stages``: the pipeline stages this rank runs; ``plans``: their plan records (each with its
    ``"stage"``), of which the lowest rank's of each stage is kept."""
    everyone = all_gather_object((list(model_keys), dict(described), dict(extra), list(stages),
                                  [dict(p) for p in plans]))
    keys0 = everyone[0][0]
    stage_plans: dict[int, dict[str, Any]] = {}
    for row in everyone:
        for p in row[4]:
            stage_plans.setdefault(int(p["stage"]), p)
    for r, (keys, _, _, st, _) in enumerate(everyone):
        if keys != keys0:
            only_r, only_0 = set(keys) - set(keys0), set(keys0) - set(keys)
            raise CheckpointError(
                f"the pipeline stages disagree on the model's keys: rank {r} (stage(s) {st}) has "
                f"{_listing(only_r) or 'no key'} that rank 0 has not, and lacks {_listing(only_0) or 'none'}"
                f"{'' if only_r or only_0 else ' (the same keys in another order)'}; every rank must build the "
                "same whole model before build_pipeline")
    rank = world()[0]
    remote: dict[str, Remote] = {}
    remote_extra: dict[str, Any] = {}
    senders: dict[str, int] = {}
    seen: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for r, (_, entries, ex, st, _) in enumerate(everyone):
        for k, d in entries.items():
            if k in seen:
                r0, d0 = seen[k]
                if (tuple(d0["shape"]), d0["dtype"]) != (tuple(d["shape"]), d["dtype"]):
                    raise CheckpointError(
                        f"the pipeline stages disagree on {k!r}: rank {r0} holds it as {tuple(d0['shape'])} "
                        f"{d0['dtype']}, rank {r} as {tuple(d['shape'])} {d['dtype']}")
            else:
                seen[k] = (r, d)
            if d["data"] and k not in senders:
                senders[k] = r
            if r != rank and k not in described and k not in remote:
                remote[k] = Remote(key=k, shape=tuple(d["shape"]), dtype=d["dtype"], primary=d["primary"],
                                   role=d["role"], owner=d["owner"], stages=tuple(st), layout=d["layout"])
        for k, v in ex.items():
            seen.setdefault(k, (r, {}))
            if r != rank and k not in extra:
                remote_extra.setdefault(k, v)
    nobody = [k for k in keys0 if k not in seen]
    if nobody:
        raise CheckpointError(f"no pipeline stage holds {_listing(nobody)} of the model: a stage must hold every "
                              "tensor of the modules it runs (the family places the embeddings, the blocks, and "
                              "the final norm and head)")
    return remote, remote_extra, senders, [stage_plans[k] for k in sorted(stage_plans)]
