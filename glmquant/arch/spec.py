"""Read a config.json (nested text_config/vision_config or flat) into a typed ModelSpec."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

from glmquant.errors import ConfigError

T = TypeVar("T")

_MLA_LAYER_TYPES = {"deepseek_sparse_attention", "indexed_attention", "full_attention", "mla"}


@dataclass(frozen=True)
class ModelSpec:
    """What every stage needs to know about a model, derived once from its config."""

    family: str  # key of the architecture table: "glm5_next", "glm4_moe", ...
    architecture: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    n_shared_experts: int
    num_mtp_layers: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    swiglu_limit: float | None
    tie_word_embeddings: bool
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per decoder layer
    attention_types: tuple[str, ...]  # "kda" | "mla" | "attention" per decoder layer
    text: Mapping[str, Any] = field(repr=False)  # the raw text config, read only by the architecture tables
    vision: Mapping[str, Any] | None = field(default=None, repr=False)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers with routed experts (the MTP layers are not counted)."""
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def mtp_layers(self) -> list[int]:
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_mtp_layers))

    @property
    def min_kept_experts(self) -> int:
        """The fewest routed experts a pruned MoE layer can route over: the router's top-k, and two per group (each of
        the n_group groups is scored by the sum of its two best experts), in whole groups."""
        per_group = max(2, -(-self.num_experts_per_tok // self.n_group))
        return per_group * self.n_group

    def dim(self, key: str, default: Any = None) -> Any:
        value = self.text.get(key, default)
        if value is None:
            raise ConfigError(f"config has no '{key}' (needed for {self.family})")
        return value


_FAMILIES = {
    "glm5_next": "glm5_next",
    "glm5_next_text": "glm5_next",
    "glm4_moe": "glm4_moe",
}
# transformers' model classes of each family, as `architectures` names them
_ARCHITECTURES = {"glm5_next": ("Glm5NextForConditionalGeneration",), "glm4_moe": ("Glm4MoeForCausalLM",)}


def read_config(path: str | Path) -> dict[str, Any]:
    """Load a config.json (a file or a directory holding one) with an error that names the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level is not a JSON object")
    return data


@overload
def text_block(config: dict[str, Any]) -> dict[str, Any]: ...  # parsed JSON: the block is a dict callers may edit


@overload
def text_block(config: Mapping[str, Any]) -> Mapping[str, Any]: ...


def text_block(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a config: its nested `text_config`, or the config itself when flat."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def load_model_spec(config: str | Path | Mapping[str, Any]) -> ModelSpec:
    """Build the spec from a config path or an already-parsed config."""
    raw = dict(config) if isinstance(config, Mapping) else read_config(config)
    text = text_block(raw)
    where = (
        "config"
        if isinstance(config, Mapping)
        else str(Path(config) / "config.json" if Path(config).is_dir() else config)
    )
    family = _family(raw, text, where)
    prefix = "text_config." if text is not raw else ""

    def required(key: str, convert: Callable[[Any], T], minimum: int | None = 1) -> T:
        """A required key of the text config, converted, or a ConfigError naming the file and the key."""
        if text.get(key) is None:
            raise ConfigError(f"{where}: missing required key '{prefix}{key}'")
        return _converted(text, key, convert, where, prefix, minimum)

    def optional(key: str, convert: Callable[[Any], T], default: T, minimum: int | None = None) -> T:
        return default if text.get(key) is None else _converted(text, key, convert, where, prefix, minimum)

    n_layers = required("num_hidden_layers", int)
    n_routed, per_token = required("n_routed_experts", int), required("num_experts_per_tok", int)
    if per_token > n_routed:
        raise ConfigError(
            f"{where}: '{prefix}num_experts_per_tok' is {per_token}, more than the {n_routed} routed experts "
            f"('{prefix}n_routed_experts')"
        )
    return ModelSpec(
        family=family,
        architecture=str((raw.get("architectures") or ["?"])[0]),
        hidden_size=required("hidden_size", int),
        vocab_size=required("vocab_size", int),
        num_hidden_layers=n_layers,
        n_routed_experts=n_routed,
        num_experts_per_tok=per_token,
        moe_intermediate_size=required("moe_intermediate_size", int),
        intermediate_size=required("intermediate_size", int),
        n_shared_experts=optional("n_shared_experts", int, 0, minimum=0),
        num_mtp_layers=optional("num_nextn_predict_layers", int, 0, minimum=0),
        routed_scaling_factor=optional("routed_scaling_factor", float, 1.0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        n_group=optional("n_group", int, 1) or 1,
        topk_group=optional("topk_group", int, 1) or 1,
        swiglu_limit=text.get("swiglu_limit"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        mlp_layer_types=_mlp_layer_types(text, n_layers, where, prefix),
        attention_types=_attention_types(family, text, n_layers, where, prefix),
        text=text,
        vision=raw.get("vision_config"),
        raw=raw,
    )


def _converted(
    text: Mapping[str, Any], key: str, convert: Callable[[Any], T], where: str, prefix: str, minimum: int | None
) -> T:
    """A JSON number of the config (an integer where `convert` is int, as transformers' configs require: "128" or
    128.0 would pass here and fail in the model), at least `minimum` when given."""
    value = text[key]
    integer = convert is int
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        expected = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: '{prefix}{key}' has a bad value {value!r} (expected {expected})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: '{prefix}{key}' is {value!r}; it must be at least {minimum}")
    return convert(value)


def _family(raw: Mapping[str, Any], text: Mapping[str, Any], where: str) -> str:
    """The architecture family, which the top level (model_type, architectures) and text_config must agree on:
    a config that says one model at the top and another in text_config would be loaded as either."""
    supported = sorted(set(_FAMILIES.values()))
    types = {"model_type": raw.get("model_type")}
    if text is not raw:
        types["text_config.model_type"] = text.get("model_type")
    families = {key: _FAMILIES.get(str(value)) for key, value in types.items() if value is not None}
    if not families:
        raise ConfigError(f"{where}: no model_type; supported: {supported}")
    unknown = [f"{key} {types[key]!r}" for key, family in families.items() if family is None]
    if unknown or len(set(families.values())) > 1:
        said = ", ".join(f"{key} {types[key]!r}" for key in families)
        reason = f"unsupported {' and '.join(unknown)}" if unknown else "the two levels name different models"
        raise ConfigError(f"{where}: {said}: {reason}; supported: {supported} (at both levels)")
    family = next(f for f in families.values() if f is not None)
    architectures = raw.get("architectures") or []
    wrong = (
        [a for a in architectures if a not in _ARCHITECTURES[family]]
        if isinstance(architectures, list)
        else [architectures]
    )
    if wrong:
        raise ConfigError(
            f"{where}: architectures {wrong} is not a {family} model class "
            f"(expected {list(_ARCHITECTURES[family])}, as model_type says)"
        )
    return family


def _mlp_layer_types(text: Mapping[str, Any], n_layers: int, where: str, prefix: str) -> tuple[str, ...]:
    types = text.get("mlp_layer_types")
    if types is None:
        first_dense = (
            0
            if text.get("first_k_dense_replace") is None
            else _converted(text, "first_k_dense_replace", int, where, prefix, 0)
        )
        types = ["dense"] * first_dense + ["sparse"] * (n_layers - first_dense)
    if not isinstance(types, (list, tuple)) or len(types) != n_layers or set(map(str, types)) - {"dense", "sparse"}:
        raise ConfigError(f"{where}: {prefix}mlp_layer_types must list 'dense'/'sparse' for each of {n_layers} layers")
    return tuple(types)


def _attention_types(family: str, text: Mapping[str, Any], n_layers: int, where: str, prefix: str) -> tuple[str, ...]:
    if family != "glm5_next":
        return ("attention",) * n_layers
    types = text.get("layer_types") or ["linear_attention" if i % 4 != 3 else "mla" for i in range(n_layers)]
    if not isinstance(types, (list, tuple)) or len(types) != n_layers:
        raise ConfigError(f"{where}: {prefix}layer_types must list one type for each of {n_layers} layers")
    out = []
    for t in types:
        if t == "linear_attention":
            out.append("kda")
        elif t in _MLA_LAYER_TYPES:
            out.append("mla")
        else:
            raise ConfigError(f"{where}: unknown layer type {t!r} in {prefix}layer_types")
    return tuple(out)
