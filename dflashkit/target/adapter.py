"""Target adapter: a transformers causal LM seen the way the decode loop needs it.

It runs the target on a span of tokens with a KV cache, returns the logits of the rows asked for and
the hidden states of the drafter's feature layers (captured with forward hooks on those decoder layers
only, never by materialising every layer), exposes the embedding table and the LM head the drafter
borrows, and crops the KV cache after a rejection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from dflashkit.errors import IncompatibleDrafterError, InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.kernels.attention import use_packed_gqa
from dflashkit.kernels.cuda_graphs import Capture
from dflashkit.kernels.linear import has_packed_linears, pack_linears, unpack_linears
from dflashkit.kernels.quantize import target_weights
from dflashkit.target.cuda_graphs import GraphCache, GraphedSteps
from dflashkit.target.cuda_graphs import unsupported_reason as graphs_unsupported_reason
from dflashkit.target.fast import FastTargetForward, ForwardCall, StaticKVCache, unsupported_reason
from dflashkit.target.loading import cache_kwargs
from dflashkit.target.logprobs import TokenLogprob, token_logprobs


class TargetAdapter:
    """Wraps an `AutoModelForCausalLM` (Llama family incl. SmolLM2, Qwen2, Qwen3, ...).

    The fast path (``fast=True``, the default): decoding runs through :class:`FastTargetForward` (fused,
    prepacked GEMMs over a preallocated KV cache; :mod:`dflashkit.target.fast`) where the architecture is
    covered, else through transformers' forward with ``nn.Linear`` layers swapped in place for prepacked
    ones (:mod:`dflashkit.kernels.linear`). ``fast=False`` leaves the linear layers alone and uses transformers'
    forward: the eager path, for debugging and comparisons. Independently, a model on transformers' "sdpa"
    attention is switched to the packed grouped-query form of :mod:`dflashkit.kernels.attention` (same maths, several
    times faster on a CPU); ``packed_attention=False`` leaves it alone. On a CUDA device the fast forward's
    decode steps are replayed from CUDA graphs (:mod:`dflashkit.kernels.cuda_graphs`) unless ``cuda_graphs=False``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        feature_layer_ids: Sequence[int] = (),
        *,
        packed_attention: bool = True,
        fast: bool = True,
        cuda_graphs: bool = True,
    ) -> None:
        if packed_attention:
            use_packed_gqa(model)
        self.fast_forward: FastTargetForward | None = None
        if fast:
            if unsupported_reason(model) is None:
                self.fast_forward = FastTargetForward(model)
            else:
                pack_linears(model)
        self.graphs: GraphedSteps | None = None
        if cuda_graphs and self.fast_forward is not None and graphs_unsupported_reason(self.fast_forward) is None:
            self.graphs = GraphedSteps(self.fast_forward)
        self.model = model.eval()
        self.config = model.config
        decoder = model.get_decoder()
        self._layers: nn.ModuleList = getattr(decoder, "layers", None)
        if self._layers is None:
            raise IncompatibleDrafterError(
                f"{type(model).__name__}: its decoder has no `layers` list, so feature layers cannot be hooked"
            )
        self.embed_tokens: nn.Module = model.get_input_embeddings()
        self._captured: dict[int, Tensor] = {}
        self._hooks: list = []
        self.feature_layer_ids: list[int] = []
        self.set_feature_layers(feature_layer_ids)

    # ---- shape facts ---------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", None) or 1 << 30)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def weights(self) -> str:
        """What the target computes with: its dtype ("bfloat16"), or "int8 weight-only (per-channel)..."."""
        return target_weights(self.model)

    @property
    def lm_head(self) -> nn.Module:
        """The target's LM head (the fast forward's prepacked one when that runs; same weights)."""
        return self.fast_forward.head if self.fast_forward is not None else self.model.get_output_embeddings()

    @property
    def engine(self) -> str:
        """Which forward decodes: the fast one, transformers' with prepacked linear layers, or the eager one."""
        if self.graphs is not None:
            return "dflashkit fast forward (static KV cache, decode steps replayed from CUDA graphs)"
        if self.fast_forward is not None:
            if self.fast_forward.fused_weights is not None:
                return f"dflashkit fast forward ({row_kernels.label()} row kernels, one call per step, static KV cache)"
            if self.fast_forward.row_exact:
                return f"dflashkit fast forward ({row_kernels.label()} row kernels, static KV cache)"
            return "dflashkit fast forward (fused prepacked GEMMs, static KV cache)"
        if has_packed_linears(self.model):
            return "transformers forward, prepacked linear layers"
        return "transformers forward (eager)"

    @property
    def fast(self) -> bool:
        return self.fast_forward is not None or has_packed_linears(self.model)

    def use_packed_linears(self, on: bool) -> None:
        """Swap the model's own linear layers for prepacked ones or back (transformers' forward only; kept
        packed, so switching back is cheap). Used to hand transformers' `generate` its original modules."""
        (pack_linears if on and self.fast_forward is None else unpack_linears)(self.model)

    # ---- feature capture -----------------------------------------------------------------------------

    def set_feature_layers(self, layer_ids: Sequence[int]) -> None:
        """Hook exactly these decoder layers (0-based; their outputs are the drafter's features)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._captured = [], {}
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise IncompatibleDrafterError(
                f"feature layers {bad} do not exist: the target has {self.num_layers} decoder layers"
            )
        self.feature_layer_ids = list(layer_ids)
        for i in dict.fromkeys(layer_ids):
            self._hooks.append(self._layers[i].register_forward_hook(self._capture_hook(i)))

    def _capture_hook(self, layer_id: int):
        def hook(_module: nn.Module, _args: tuple, output: Tensor | tuple) -> None:
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    # ---- running the target --------------------------------------------------------------------------

    def use_step_graphs(self, capture: Capture | None = None) -> None:
        """Replay decode steps from graphs (:mod:`dflashkit.kernels.cuda_graphs`). ``capture`` None: CUDA graphs (a CUDA
        device); another capture function stands in for them, e.g. in tests on a CPU."""
        if self.fast_forward is None:
            raise InvalidInputError("step graphs need the fast forward (TargetAdapter(..., fast=True))")
        self.graphs = GraphedSteps(self.fast_forward, capture)

    def new_cache(self, capacity: int | None = None) -> DynamicCache | StaticKVCache:
        """An empty KV cache for one generation; `capacity`: the positions it will likely need (it grows, except
        with graphs, whose caches hold at least `capacity` positions and never grow)."""
        if self.graphs is not None:
            return self.graphs.new_cache(capacity or 256)
        if self.fast_forward is not None:
            return self.fast_forward.new_cache(capacity or 256)
        return DynamicCache(config=self.config)

    @property
    def supports_trees(self) -> bool:
        """Whether :meth:`forward` takes a token tree (the fast forward does; transformers' forward is not run on
        trees)."""
        return self.fast_forward is not None

    @property
    def batches_passes(self) -> bool:
        """Whether :meth:`forward_batch` runs several sequences' calls as one pass (the fast forward on the CPU row
        kernels' one-call layers; elsewhere the calls run one after another)."""
        return self.fast_forward is not None and self.graphs is None and self.fast_forward.fused_weights is not None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        start: int,
        cache: DynamicCache | StaticKVCache,
        logits_rows: int,
        tree: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run tokens input_ids [1, n] at positions start..start+n-1, appending them to `cache`.

        Returns the logits of the last `logits_rows` rows [logits_rows, vocab] (in the model's dtype) and
        the concatenated feature-layer outputs [1, n, n_feat*hidden] (None without feature layers).
        ``tree`` = (position offsets [n], visibility bool [n, n]): the tokens are a token tree
        (:mod:`dflashkit.decoding.tree`; fast forward only, see :attr:`supports_trees`); keep the accepted path with
        :meth:`keep_rows`.
        """
        n = input_ids.shape[1]
        self._check_call(input_ids, start, cache, tree)
        if isinstance(cache, StaticKVCache):
            if isinstance(cache, GraphCache) and self.graphs is not None:
                return self.graphs(input_ids, start, cache, logits_rows, self.feature_layer_ids, tree)
            return self.fast_forward(input_ids, start, cache, logits_rows, self.feature_layer_ids, tree)
        positions = torch.arange(start, start + n, device=input_ids.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions[None],
            cache_position=positions,
            **cache_kwargs(self.model, cache),
            use_cache=True,
            logits_to_keep=logits_rows,
        )
        features = None
        if self.feature_layer_ids:
            features = torch.cat([self._captured[i] for i in self.feature_layer_ids], dim=-1)
            self._captured.clear()
        return out.logits[0], features

    def _check_call(
        self, input_ids: Tensor, start: int, cache: DynamicCache | StaticKVCache, tree: tuple[Tensor, Tensor] | None
    ) -> None:
        n = input_ids.shape[1]
        depth = n if tree is None else int(tree[0].max()) + 1
        if start + depth > self.max_positions:
            raise InvalidInputError(
                f"context of {start + depth} tokens exceeds the target's maximum of {self.max_positions} positions"
            )
        if tree is not None and not (self.supports_trees and isinstance(cache, StaticKVCache)):
            raise InvalidInputError("token trees need the fast forward and its StaticKVCache")
        if isinstance(cache, StaticKVCache) and self.fast_forward is None:
            raise InvalidInputError("a StaticKVCache needs the fast forward (TargetAdapter(..., fast=True))")

    def forward_call(self, call: ForwardCall) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward` of one :class:`~dflashkit.target.fast.ForwardCall`."""
        return self.forward(call.input_ids, call.start, call.cache, call.logits_rows, call.tree)

    @torch.inference_mode()
    def forward_batch(self, calls: Sequence[ForwardCall]) -> list[tuple[Tensor, Tensor | None]]:
        """Several sequences' :meth:`forward` calls (each with its own cache): their results, in order.

        On the fast forward's one-call row kernels they run as one pass (every product once over all their rows,
        each sequence attending over its own cache: :meth:`FastTargetForward.batch`), elsewhere one after another;
        either way each result is bitwise what its call alone returns.
        """
        batched = (
            self.fast_forward is not None
            and self.graphs is None
            and len(calls) > 1
            and all(type(c.cache) is StaticKVCache for c in calls)
        )
        if not batched:  # each call checked by forward
            return [self.forward_call(call) for call in calls]
        for c in calls:
            self._check_call(c.input_ids, c.start, c.cache, c.tree)
        return self.fast_forward.batch(list(calls), self.feature_layer_ids)

    @torch.inference_mode()
    def features(self, input_ids: Tensor) -> Tensor:
        """Feature-layer outputs [batch, n, n_feat*hidden] of whole sequences, no cache, no logits (training).

        Right padding is harmless: attention is causal, so padding never reaches the real positions.
        """
        return self._decoder_pass(input_ids)[0]

    @torch.inference_mode()
    def features_and_top_logprobs(
        self, input_ids: Tensor, k: int, chunk: int | None = None, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Like :meth:`features`, plus the target's own next-token distribution at every position, kept as its
        k most likely tokens: ids [batch, n, k] (long) and their log-probabilities [batch, n, k] (fp32, over the
        whole vocabulary, so the mass outside the top k is 1 - sum(exp)). Soft labels for distillation.

        ``positions`` [batch, n] (bool): the rows that need them (training: those whose next token carries loss;
        prompts are ~45% of a batch's rows in the shipped drafter's data); the others get ids 0 and
        log-probabilities -inf (no mass). The LM head runs over `chunk` rows at a time ([chunk, vocab] fp32
        logits), never over the whole batch: by default 512 on a CPU (the chunk stays in cache) and 8,192
        elsewhere (a GPU's training step is bound by the host launching its ~14K operations, 19K rows of 512
        adding ~150 more).
        """
        if chunk is None:
            chunk = 512 if self.device.type == "cpu" else 8192
        features, hidden = self._decoder_pass(input_ids)  # hidden: [batch, n, hidden], after the final norm
        rows = hidden.reshape(-1, hidden.shape[-1])  # [batch * n, hidden]
        picked = positions.reshape(-1).nonzero().squeeze(1) if positions is not None else None
        if picked is not None:
            rows = rows[picked]  # [rows needed, hidden]
        ids, logprobs = [], []
        for lo in range(0, rows.shape[0], chunk):
            lp = self.lm_head(rows[lo : lo + chunk]).float().log_softmax(-1)  # [chunk, vocab]
            top = lp.topk(k, dim=-1)
            ids.append(top.indices)
            logprobs.append(top.values)
        shape = (*hidden.shape[:2], k)
        top_ids = torch.cat(ids) if ids else torch.zeros(0, k, dtype=torch.long, device=hidden.device)
        top_lp = torch.cat(logprobs) if logprobs else torch.zeros(0, k, device=hidden.device)
        if picked is None:
            return features, top_ids.view(shape), top_lp.view(shape)
        all_ids = torch.zeros(shape[0] * shape[1], k, dtype=torch.long, device=hidden.device)
        all_lp = torch.full((shape[0] * shape[1], k), float("-inf"), device=hidden.device)
        all_ids[picked], all_lp[picked] = top_ids, top_lp
        return features, all_ids.view(shape), all_lp.view(shape)

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: list[int], top: int, chunk: int = 512) -> list[TokenLogprob]:
        """The log-probability of each prompt token after the ones before it (tokens 1..n-1; the first has no
        context), with its `top` alternatives: one pass of the decoder over the prompt, the LM head `chunk` rows
        at a time. For scoring text (e.g. the completions API's echo)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        hidden = self._decoder_pass(ids)[1][0, :-1]  # [n-1, hidden]: position i predicts token i+1
        out: list[TokenLogprob] = []
        for lo in range(0, hidden.shape[0], chunk):
            out += token_logprobs(self.lm_head(hidden[lo : lo + chunk]), prompt_ids[lo + 1 : lo + 1 + chunk], top)
        return out

    def _decoder_pass(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The decoder over whole sequences (no cache): feature-layer outputs and the final-normed hidden states
        (the fast forward's where it covers the target: the features decoding gives the drafter, with a third of
        the kernels of transformers' forward)."""
        if self.fast_forward is not None:
            hidden, features = self.fast_forward.sequences(input_ids, self.feature_layer_ids)
        else:
            hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
            features = (
                torch.cat([self._captured[i] for i in self.feature_layer_ids], dim=-1)
                if self.feature_layer_ids
                else None
            )
            self._captured.clear()
        return (features if features is not None else hidden.new_zeros(*hidden.shape[:2], 0)), hidden

    @staticmethod
    def crop(cache: DynamicCache | StaticKVCache, length: int) -> None:
        """Keep the first `length` positions of the cache (drops rejected draft positions)."""
        if isinstance(cache, StaticKVCache):
            cache.crop(length)
            return
        surplus = cache.get_seq_length() - length
        if surplus > 0:
            cache.crop(-surplus)  # transformers >= 5.23 takes the number of tokens to remove, negated

    @staticmethod
    def keep_rows(cache: StaticKVCache, start: int, rows: list[int]) -> None:
        """After a tree's verify pass from `start`: keep the rows of the accepted path (relative to start,
        increasing, the anchor's 0 first) as positions start, start+1, ...; drop the rest."""
        cache.keep_rows(start, rows)

    @torch.inference_mode()
    def snapshot(self, cache: DynamicCache | StaticKVCache, length: int) -> tuple[Tensor, Tensor] | None:
        """Copies of the cached keys and values of positions < length, [layers, kv_heads, length, head_dim] each
        (for :mod:`dflashkit.decoding.prefix_cache`); None where the cache does not hold every layer's positions <
        length
        (e.g. a sliding-window layer of transformers' cache)."""
        if isinstance(cache, StaticKVCache):
            if cache.length < length:
                return None
            return cache.keys[:, :, :length].clone(), cache.values[:, :, :length].clone()
        layers = self.cached_key_values(cache)
        if not layers or any(k.shape[1] < length or v.shape[1] < length for k, v in layers):
            return None
        return (torch.stack([k[:, :length] for k, _ in layers]), torch.stack([v[:, :length] for _, v in layers]))

    @torch.inference_mode()
    def restore(self, keys: Tensor, values: Tensor, length: int, capacity: int) -> DynamicCache | StaticKVCache:
        """A new cache (see :meth:`new_cache`) holding positions < length of a :meth:`snapshot`."""
        cache = self.new_cache(capacity)
        if isinstance(cache, StaticKVCache):
            cache.reserve(length)
            cache.keys[:, :, :length] = keys[:, :, :length]
            cache.values[:, :, :length] = values[:, :, :length]
            cache.length = length
            return cache
        for i in range(keys.shape[0]):
            cache.update(keys[i, :, :length][None].clone(), values[i, :, :length][None].clone(), i)
        return cache

    @staticmethod
    def cached_key_values(cache: DynamicCache | StaticKVCache) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the cached keys and values [kv_heads, length, head_dim] (batch 1; for checks and tests)."""
        if isinstance(cache, StaticKVCache):
            return [cache.layer(i) for i in range(cache.keys.shape[0])]
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]

    @torch.inference_mode()
    def embed(self, input_ids: Tensor) -> Tensor:
        """Target token embeddings [batch, n, hidden] (the drafter's input table, frozen)."""
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """Target LM head on drafter hidden states [..., hidden] -> [..., vocab]."""
        return self.lm_head(hidden)
