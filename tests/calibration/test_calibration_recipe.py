"""Recipe parsing: the shipped recipes load; every mistake names the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmquant.calibration import load_recipe
from glmquant.errors import UsageError

RECIPES = Path(__file__).resolve().parents[2] / "calibration"


def test_shipped_recipes_load() -> None:
    default = load_recipe(RECIPES / "default.yaml")
    assert [lane.name for lane in default.lanes] == ["mix"] and default.lanes[0].use == ("hessians", "reap")
    prose = default.sources["prose"].path
    assert prose is not None and Path(prose).is_file()  # resolved against the recipe's directory
    real = load_recipe(RECIPES / "glm-5.3-flash.yaml")
    hessian = real.lanes[0]
    assert (hessian.name, hessian.rows, hessian.tokens, hessian.use) == ("hessian", 600, 2048, ("hessians",))
    reap = [lane for lane in real.lanes if "reap" in lane.use]
    assert len(reap) >= 4 and all((lane.rows, lane.tokens) == (128, 1024) for lane in reap)
    assert real.sources["chat"].kind == "hf" and real.sources["chat"].format == "chat"


def test_shape_override_and_hash() -> None:
    recipe = load_recipe(RECIPES / "default.yaml")
    small = recipe.with_shape(rows=3, tokens=16)
    assert (small.lanes[0].rows, small.lanes[0].tokens) == (3, 16)
    assert small.sha256({}) != recipe.sha256({}) and recipe.sha256({}) == recipe.sha256({})
    assert recipe.sha256({"prose": "x"}) != recipe.sha256({"prose": "y"})  # data content is part of it
    with pytest.raises(UsageError, match="--rows"):
        recipe.with_shape(rows=0)


LANE = "name: x\nsources: {a: {kind: random}}\nlanes: [{name: l, rows: 2, tokens: 4, mix: [{source: a}]"
BAD = [
    ("name: x\nsources: {}\nlanes: []\n", "lanes: at least one lane"),
    ("sources: {}\nlanes: []\n", "name: required key is missing"),
    ("name: x\nsources: {a: {kind: text}}\nlanes: []\n", "sources.a.path: required for kind text"),
    ("name: x\nsources: {a: {kind: web}}\nlanes: []\n", "sources.a.kind: must be one of"),
    (
        "name: x\nsources: {a: {kind: random}}\nlanes: [{name: l, rows: 2, tokens: 4, mix: [{source: b}]}]\n",
        r"lanes\[0\].mix\[0\].source: no source named 'b'",
    ),
    (
        "name: x\nsources: {a: {kind: random}}\nlanes: [{name: l, rows: two, tokens: 4, mix: [{source: a}]}]\n",
        r"lanes\[0\].rows: expected int, got 'two'",
    ),
    (LANE + ", colour: red}]\n", r"lanes\[0\].colour: unknown key"),
    (LANE + ", use: [train]}]\n", r"lanes\[0\].use: must list some of hessians, reap"),
    (
        "name: x\nsources: {a: {kind: hf, dataset: d, response_field: y}}\nlanes: []\n",
        "response_field: only meaningful with format: chat",
    ),
    ("name: [unclosed\n", "not valid YAML"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_errors_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as info:
        load_recipe(path)
    assert str(info.value).startswith(str(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read recipe"):
        load_recipe(tmp_path / "nope.yaml")
