"""Drafter configuration: the shape of a DFlash drafter and which target it belongs to.

The fields mirror the `config.json` of published DFlash drafters (z-lab layout: a Qwen3-style layer
config plus `block_size`, `num_target_layers` and `dflash_config`), so that official drafters load here
and ours load in vLLM, SGLang and llama.cpp. Metadata that identifies the target lives under the
extra key `dflashkit`, which other engines ignore.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflashkit.errors import CheckpointError, InvalidInputError


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Default target layers feeding the drafter: spread uniformly from layer 1 to layer L-3.

    Same rule as the reference (incl. Python's banker's rounding). An id `l` is the output of decoder
    layer `l` (0-based), i.e. `hidden_states[l + 1]` in transformers' numbering.
    """
    if num_features < 1:
        raise InvalidInputError(f"need at least one target feature layer, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise InvalidInputError(
            f"target has {num_target_layers} layers: too few to pick {num_features} feature layers "
            "by the default rule; "
            "pass target_layer_ids explicitly"
        )
    return [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]


def rope_theta_of(target_config: Any) -> float:
    """RoPE base of a transformers config (v5 keeps it in `rope_parameters`, v4 at top level)."""
    params = getattr(target_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(target_config, "rope_theta", 10000.0))


def check_context_window(window: object) -> int | None:
    """A drafter context window: None (all context tokens) or a positive integer."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InvalidInputError(f"the drafter's context window must be a positive integer or None, got {window!r}")
    return window


def check_proposal_temperature(ratio: object) -> float:
    """A proposal temperature: the multiple of the request's temperature the drafter samples at (finite, > 0)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < float("inf"):
        raise InvalidInputError(
            f"the proposal temperature must be a finite number > 0 (a multiple of the sampling "
            f"temperature), got {ratio!r}"
        )
    return float(ratio)


@dataclass
class DrafterConfig:
    """Shape and conditioning of a DFlash drafter."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # drafter depth
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 8192
    # True: a learned mask vector (saved as `mask_embedding.pt`) replaces the target's embedding row of
    # `mask_token_id` for the drafter; needed when the vocabulary has no spare id.
    learned_mask_embedding: bool = False
    # Token ids the drafter may propose (sorted), None = the whole vocabulary. A drafter trained with a
    # draft vocabulary proposes only from it (and its LM head pass reads only those rows: faster).
    draft_vocab: list[int] | None = None
    # Identity of the target this drafter was built for (see identity.target_identity); None = unknown.
    target: dict[str, Any] | None = field(default=None)
    # At inference, a drafting step attends to at most this many of the latest context tokens (None: all of
    # them). A drafter trained on short sequences drafts worse over contexts longer than it ever saw.
    context_window: int | None = None
    # When sampling, drafts are drawn at this multiple of the request's temperature. Any proposal is exact; a
    # drafter whose distribution is flatter than the target's is accepted more often sharpened (< 1), measured
    # per drafter with scripts/draft_temperature.py.
    proposal_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise InvalidInputError(f"block_size must be at least 2 (anchor + one draft), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise CheckpointError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise CheckpointError(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")
        check_context_window(self.context_window)
        check_proposal_temperature(self.proposal_temperature)
        if self.draft_vocab is not None and (
            not self.draft_vocab or min(self.draft_vocab) < 0 or max(self.draft_vocab) >= self.vocab_size
        ):
            raise CheckpointError(f"draft_vocab must be a non-empty list of ids below {self.vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        num_features: int | None = None,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target's layers (same hidden size, heads, RoPE), as the paper does.

        Without `mask_token_id`, a learned mask embedding is used and the id is the last vocabulary row
        (it names the row the vector replaces in the drafter's input, wherever that id occurs, the anchor
        included: the convention of vLLM and of llama.cpp's converter too).
        """
        c = target_config
        n_layers = int(c.num_hidden_layers)
        layer_ids = list(target_layer_ids or build_target_layer_ids(n_layers, num_features or num_layers))
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        return cls(
            hidden_size=int(c.hidden_size),
            intermediate_size=int(intermediate_size or c.intermediate_size),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            vocab_size=int(c.vocab_size),
            num_target_layers=n_layers,
            target_layer_ids=layer_ids,
            mask_token_id=int(c.vocab_size - 1 if mask_token_id is None else mask_token_id),
            block_size=block_size,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(c),
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
            learned_mask_embedding=mask_token_id is None,
        )

    # ---- published config.json layout -------------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """`config.json` in the layout of published DFlash drafters (read by vLLM, SGLang, llama.cpp)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
            "dflashkit": {
                "format_version": 1,
                "learned_mask_embedding": self.learned_mask_embedding,
                "draft_vocab": self.draft_vocab,
                "target": self.target,
                "context_window": self.context_window,
                "proposal_temperature": self.proposal_temperature,
            },
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Read a published-layout `config.json` (ours or an official drafter's)."""

        def field(key: str, cast: type = int, default: Any = None, source: dict[str, Any] = d) -> Any:
            value = source.get(key, default)
            if value is None:
                raise CheckpointError(f"drafter config.json lacks the field {key!r}")
            try:
                return cast(value)
            except (TypeError, ValueError) as e:
                raise CheckpointError(
                    f"drafter config.json: field {key!r} must be {cast.__name__}, got {value!r}"
                ) from e

        dflash = d.get("dflash_config") or {}
        ours = d.get("dflashkit") or {}
        if not isinstance(dflash, dict) or not isinstance(ours, dict):
            raise CheckpointError("drafter config.json: dflash_config and dflashkit must be objects")
        for key in ("rope_scaling", "rope_parameters"):
            rope = d.get(key)
            if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise CheckpointError(f"{key} {rope} is not supported yet (only plain RoPE)")
        if any(t != "full_attention" for t in d.get("layer_types") or []) or d.get("use_sliding_window"):
            raise CheckpointError(
                "sliding-window drafter layers are not supported yet (dflashkit's context window, "
                "`dflashkit generate --draft-window N`, limits what every layer attends to)"
            )
        n_layers = field("num_hidden_layers")
        n_target = field("num_target_layers", default=0)
        layer_ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if layer_ids is None:
            if not n_target:
                raise CheckpointError("config has neither dflash_config.target_layer_ids nor num_target_layers")
            layer_ids = build_target_layer_ids(n_target, n_layers)
        if not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids):
            raise CheckpointError(f"dflash_config.target_layer_ids must be a list of integers, got {layer_ids!r}")
        try:
            window = check_context_window(ours.get("context_window"))
            proposal_temperature = check_proposal_temperature(ours.get("proposal_temperature", 1.0))
        except InvalidInputError as e:
            raise CheckpointError(f"drafter config.json: {e}") from e
        heads = field("num_attention_heads")
        hidden = field("hidden_size")
        rope_theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6))
        return cls(
            hidden_size=hidden,
            intermediate_size=field("intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=field("num_key_value_heads", default=heads),
            head_dim=field("head_dim", default=hidden // heads),
            vocab_size=field("vocab_size"),
            num_target_layers=n_target or max(layer_ids) + 1,
            target_layer_ids=layer_ids,
            mask_token_id=field("mask_token_id", source=dflash, default=d.get("mask_token_id")),
            block_size=field("block_size", default=dflash.get("block_size", 16)),
            rms_norm_eps=field("rms_norm_eps", float, 1e-6),
            rope_theta=field("rope_theta", float, rope_theta),
            max_position_embeddings=field("max_position_embeddings", default=8192),
            learned_mask_embedding=bool(ours.get("learned_mask_embedding", False)),
            draft_vocab=ours.get("draft_vocab"),
            target=ours.get("target"),
            context_window=window,
            proposal_temperature=proposal_temperature,
        )

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)
