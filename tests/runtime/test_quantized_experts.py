"""Rank-stacked virtual experts sum to the un-sliced expert; the decode cache is bounded and counted."""

from __future__ import annotations

import pytest
import torch

from glmquant.exl3 import decode_weight
from glmquant.runtime.artifact import open_artifact
from glmquant.runtime.expert_cache import LRUCache
from glmquant.runtime.loader import hf_config
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import BACKENDS, ExpertBackend, QuantizedExperts, expand_routes
from glmquant.runtime.torch_backend import TorchExpertBackend


def _routes(spec, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, spec.hidden_size, generator=gen)
    ids = torch.stack(
        [torch.randperm(spec.n_routed_experts, generator=gen)[: spec.num_experts_per_tok] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, spec.num_experts_per_tok, generator=gen) * 2.5
    return hidden, ids, weights


def test_expand_routes_gives_each_rank_the_same_weight():
    ids, weights = expand_routes(torch.tensor([[2, 0]]), torch.tensor([[0.25, 0.75]]), ranks=4)
    assert ids.tolist() == [[8, 9, 10, 11, 0, 1, 2, 3]]
    assert weights.tolist() == [[0.25] * 4 + [0.75] * 4]
    same_ids, same_weights = expand_routes(torch.tensor([[2, 0]]), torch.tensor([[0.25, 0.75]]), ranks=1)
    assert same_ids.tolist() == [[2, 0]] and same_weights.tolist() == [[0.25, 0.75]]


def test_rank_stacked_equals_unsliced_transformers_experts(artifacts):
    """tr3: 4 slices x top-k virtual routes reproduce transformers' experts on the concatenated weights."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts

    artifact = open_artifact(artifacts["tr3"])
    spec, layer = artifact.spec, 2
    backend = TorchExpertBackend(artifact, cache_size=64, dtype=torch.float32)
    config = hf_config(artifact, "float32").get_text_config()
    config._experts_implementation = "eager"  # transformers' reference loop over experts
    dense = Glm5NextTextExperts(config)
    with torch.no_grad():
        for e in range(spec.n_routed_experts):
            full = {
                p: torch.cat(
                    [decode_weight(artifact.read_expert(layer, 4 * e + r, p), torch.float32) for r in range(4)],
                    dim=1 if p == "down_proj" else 0,
                )
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            dense.gate_up_proj[e] = torch.cat((full["gate_proj"], full["up_proj"]))
            dense.down_proj[e] = full["down_proj"]
        hidden, ids, weights = _routes(spec, tokens=24)
        want = dense(hidden, ids, weights)
        got = QuantizedExperts(layer, 4, backend)(hidden, ids, weights)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert backend.stats().misses == 4 * spec.n_routed_experts  # each used virtual expert decoded once


def test_results_do_not_depend_on_cache_size(artifacts):
    artifact = open_artifact(artifacts["exllamav3"])
    hidden, ids, weights = _routes(artifact.spec, tokens=16, seed=1)
    no_cache = TorchExpertBackend(artifact, cache_size=0, dtype=torch.float32)
    small = TorchExpertBackend(artifact, cache_size=2, dtype=torch.float32)
    first = small.forward(1, hidden, ids, weights)
    assert torch.equal(first, no_cache.forward(1, hidden, ids, weights))
    assert torch.equal(small.forward(1, hidden, ids, weights), first)
    used = len(torch.unique(ids))
    assert used == artifact.spec.n_routed_experts > 2
    stats = small.stats()  # experts are visited in id order, so an LRU smaller than the set never hits
    assert (stats.resident, stats.hits, stats.misses, stats.evictions) == (2, 0, 2 * used, 2 * used - 2)
    assert no_cache.stats().resident == 0 and no_cache.stats().hits == 0
    full = TorchExpertBackend(artifact, cache_size=used, dtype=torch.float32)
    full.forward(1, hidden, ids, weights)
    assert torch.equal(full.forward(1, hidden, ids, weights), first)
    assert (full.stats().hits, full.stats().misses, full.stats().hit_rate) == (used, used, 0.5)


def test_lru_keeps_the_most_recently_used():
    cache: LRUCache[int] = LRUCache(2)
    loads = []

    def get(k):
        return cache.get(k, lambda: loads.append(k) or k)

    for key in ("a", "b", "a", "c", "a", "b"):
        get(key)
    assert loads == ["a", "b", "c", "b"]  # "b" was evicted by "c" ("a" was used more recently)
    assert (cache.stats().hits, cache.stats().misses, cache.stats().evictions) == (2, 4, 2)
    with pytest.raises(ValueError):
        LRUCache(-1)


def test_torch_backend_is_registered_and_satisfies_the_interface(artifacts):
    backend = BACKENDS["torch"](open_artifact(artifacts["tr3"]), RuntimeOptions(expert_cache=3))
    assert isinstance(backend, TorchExpertBackend) and backend.stats().capacity == 3
    assert isinstance(backend, ExpertBackend)
