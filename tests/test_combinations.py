"""docs/combinations.md cannot drift from the code and the tests (in one process, no launch).

- The list names each feature alone and each pair exactly once; the grid says the same.
- "works": every test it names exists (the file, the function, the parametrize id).
- "refused": building that pair (each strategy, and ``MatrixFSDPConfig``) raises
  ``MatrixShardError`` with the message shown; every other cell's pair builds.
- "not yet": the reason quoted is the library's own text, and the test named exists.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "combinations.md"
#: Each feature's options, as the page's first table says (Fabric: the Fabric strategy instead).
FEATURES: dict[str, dict[str, Any]] = {
    "HSDP": {"shard_size": 1}, "TP": {"tensor_parallel_size": 2}, "EP": {"expert_parallel_size": 2},
    "split stacks": {"split_stacks": True}, "replica_split": {"replica_split": True},
    "async save": {"async_save": True}, "Fabric": {},
}
STATUSES = {"works", "refused", "not yet", "no effect"}
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([\w-]+)\])?`")


def _table(marker: str) -> list[list[str]]:
    text = PAGE.read_text()
    found = re.search(rf"<!-- combinations: {marker} -->\n((?:\|.*\n)+)", text)
    assert found, f"docs/combinations.md has no table marked <!-- combinations: {marker} -->"
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in found.group(1).splitlines()[2:]]


def _rows() -> dict[frozenset[str], tuple[str, str]]:
    rows: dict[frozenset[str], tuple[str, str]] = {}
    for features, status, evidence in _table("list"):
        key = frozenset(features.split(" + "))
        assert key <= FEATURES.keys() and len(key) == len(features.split(" + ")), f"unknown features: {features}"
        assert key not in rows, f"listed twice: {features}"
        assert status in STATUSES, f"{features}: status {status!r}, not one of {sorted(STATUSES)}"
        rows[key] = (status, evidence)
    return rows


ROWS = _rows()


def test_every_feature_and_every_pair_is_listed_once_and_the_grid_agrees():
    want = {frozenset([f]) for f in FEATURES} | {frozenset(p) for p in itertools.combinations(FEATURES, 2)}
    assert set(ROWS) == want, (f"missing: {sorted(map(sorted, want - set(ROWS)))}; "
                               f"extra: {sorted(map(sorted, set(ROWS) - want))}")
    grid = _table("grid")
    assert [r[0].strip("*") for r in grid] == list(FEATURES), [r[0] for r in grid]
    wrong = [f"{row[0]} x {col}: grid {cell!r}, list {ROWS[frozenset([row[0].strip('*'), col])][0]!r}"
             for row in grid for col, cell in zip(FEATURES, row[1:])
             if cell != ROWS[frozenset([row[0].strip("*"), col])][0]]
    assert not wrong, "docs/combinations.md: the grid and the list differ:\n" + "\n".join(wrong)


def _build(features: frozenset[str], config: bool) -> Any:
    options = {k: v for f in sorted(features) for k, v in FEATURES[f].items()}
    if config:
        return MatrixFSDPConfig(**options)
    cls = mf.MatrixFSDPFabricStrategy if "Fabric" in features else mf.MatrixFSDPStrategy
    return cls(log_plan=False, **options)


@pytest.mark.parametrize("features", sorted(ROWS, key=sorted), ids=lambda k: "+".join(sorted(k)))
def test_each_combination_is_built_or_refused_as_the_page_says(features):
    status, evidence = ROWS[features]
    if status != "refused":
        _build(features, config=False)
        _build(features, config=True)
        return
    message = re.search(r"`([^`]+)`", evidence)
    assert message, f"{' + '.join(sorted(features))}: a refused row shows its message in backticks"
    for config in (False, True):
        with pytest.raises(mf.MatrixShardError) as err:
            _build(features, config)
        assert message.group(1) in str(err.value), (sorted(features), str(err.value))


@pytest.mark.parametrize("features", sorted(ROWS, key=sorted), ids=lambda k: "+".join(sorted(k)))
def test_the_tests_and_reasons_named_exist(features):
    status, evidence = ROWS[features]
    refs = TEST_REF.findall(evidence)
    if status == "works":
        assert refs, f"{' + '.join(sorted(features))}: a works row names the test that shows it"
    for path, name, param in refs:
        source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"
        assert not param or re.search(rf"[\"']{re.escape(param)}[\"']", source), f"{path}: no parametrize id {param}"
    if status == "not yet":
        quoted = [q for q in re.findall(r"`([^`]+)`", evidence) if not q.startswith("tests/")]
        assert quoted, f"{' + '.join(sorted(features))}: a not-yet row quotes what the plan printout says"
        library = "\n".join(f.read_text() for f in sorted((ROOT / "lightning_matrixfsdp").rglob("*.py")))
        for q in quoted:
            assert q in library, f"{' + '.join(sorted(features))}: {q!r} is not the library's text"
