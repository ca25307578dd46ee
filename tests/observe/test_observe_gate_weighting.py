"""Gate-weighted natural Hessians (observe --hessian-weighting gate): Σ ĝ² x xᵀ over each expert's routed tokens,
ĝ its routing weight over the mean weight of its token's top-k, against direct sums on transformers' full model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from observe_helpers import observe_config
from test_observe_reference import _act_bf16, _close

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.provenance import calibration_info
from glmquant.errors import UsageError
from glmquant.observe.config import fingerprint
from glmquant.observe.hessian_reader import load_layer_hessians
from glmquant.observe.hessians import HessianMode, HessianWeighting
from glmquant.observe.run import observe
from glmquant.observe.summary import ObservationSummary


@pytest.fixture(scope="module")
def gated(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gated")
    observe(observe_config(tiny_source, out, hessian_weighting="gate"))  # the shared observation's settings, gated
    return out


def test_gate_weighted_hessians_equal_direct_sums(gated: Path, observed: Path, reference) -> None:
    for layer, cap in reference.layers.items():
        experts = reference.model.model.language_model.layers[layer].mlp.experts
        x, weights, indices = torch.cat(cap.x), torch.cat(cap.weights).double(), torch.cat(cap.indices)
        relative = weights / weights.mean(dim=-1, keepdim=True)
        hessians = load_layer_hessians(gated, layer, "natural")
        plain = load_layer_hessians(observed, layer, "natural")
        for j in range(experts.num_experts):
            routed = (indices == j).any(dim=-1)
            xj, g = x[routed], (relative * (indices == j)).sum(dim=-1)[routed]
            gate_up, down = hessians.gate_up(j), hessians.down(j)
            assert gate_up.count == down.count == plain.gate_up(j).count == xj.shape[0]  # tokens, not weights
            _close(gate_up.sum, (xj.double() * g[:, None] ** 2).T @ xj.double(), 1e-5)
            act = _act_bf16(experts, j, xj).double()
            _close(down.sum, (act * g[:, None] ** 2).T @ act, 1e-3)
            if xj.shape[0] > 1 and not torch.allclose(g, g[:1].expand_as(g)):  # unequal gates: another matrix
                assert not torch.allclose(gate_up.sum, plain.gate_up(j).sum, rtol=1e-3)
    assert ObservationSummary.load(gated).hessian_weighting == "gate"
    assert ObservationSummary.load(observed).hessian_weighting == "token"


def test_only_the_natural_sums_are_weighted(gated: Path, observed: Path) -> None:
    """All-token and dense sums, and every count, are the unweighted run's, bit for bit."""
    files = sorted(p.name for p in observed.glob("layer-*.hessians.safetensors"))
    assert files == sorted(p.name for p in gated.glob("layer-*.hessians.safetensors")) and files
    natural_differs = []
    for file in files:
        with SourceCheckpoint.open(gated / file) as got, SourceCheckpoint.open(observed / file) as want:
            assert got.names() == want.names()
            for name in want.names():
                same = torch.equal(got.read_tensor(name), want.read_tensor(name))
                if name.startswith("natural.") and name.endswith(".sum"):
                    natural_differs.append(not same)
                else:
                    assert same, f"{file}: {name}"
    assert natural_differs and all(natural_differs)


def test_gate_weighting_needs_natural_hessians_and_is_stated_in_the_provenance(tiny_source: Path) -> None:
    with pytest.raises(UsageError, match="natural or both, not all"):
        observe_config(tiny_source, Path("unused"), hessians=HessianMode.ALL, hessian_weighting=HessianWeighting.GATE)
    with pytest.raises(UsageError, match="must be one of token, gate, not 'size'"):
        observe_config(tiny_source, Path("unused"), hessian_weighting="size")
    with pytest.raises(UsageError, match="natural or both, not all"):  # text settings are checked the same way
        observe_config(tiny_source, Path("unused"), hessians="all", hessian_weighting="gate")
    token = fingerprint(observe_config(tiny_source, Path("unused")), "rows", torch.bfloat16, False, "vectors")
    gate_config = observe_config(tiny_source, Path("unused"), hessian_weighting="gate")
    gate = fingerprint(gate_config, "rows", torch.bfloat16, False, "vectors")
    assert "hessian_weighting" not in token and gate == {**token, "hessian_weighting": "gate"}  # old runs resume
    lanes = [(4, 32)]
    assert calibration_info("r.yaml", "a", "b", lanes, "natural", "gate").routing == "natural+gate-weighted"
    assert calibration_info("r.yaml", "a", "b", lanes, "blend:0.5", "gate").routing == "blend:0.5+gate-weighted"
    assert calibration_info("r.yaml", "a", "b", lanes, "all", "gate").routing == "all-token"
    assert calibration_info("r.yaml", "a", "b", lanes, "natural").routing == "natural"
