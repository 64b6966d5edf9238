"""The DFlash drafter network: Qwen3-style layers with KV injection of fused target features.

A block of B tokens (the last verified token, then B-1 mask tokens) is denoised in one forward pass.
Target hidden states from a few layers are concatenated, projected by `fc` and normalised by
`hidden_norm`; every drafter layer turns that fused context into extra keys/values with its own K/V
weights. Block queries attend, without a causal mask, to all context keys and to their own block.

The drafter has no embedding or LM head: callers embed with the target's table and read logits with the
target's head. Parameter names follow the published checkpoint layout (`layers.0.self_attn.q_proj.weight`,
`fc.weight`, `hidden_norm.weight`, `norm.weight`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.context import KV, ContextCache
from dflashkit.drafter.fast import DraftStep, FastDrafterForward, registrations
from dflashkit.drafter.layers import BlockMask, DrafterLayer, RMSNorm, RotaryEmbedding
from dflashkit.drafter.ngram_store import NgramStore
from dflashkit.drafter.text_columns import TextColumns
from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.kernels.int4 import Int4Linear
from dflashkit.kernels.int8 import Int8Linear
from dflashkit.kernels.linear import PackedLinear
from dflashkit.kernels.quantize import WEIGHT_ONLY

if TYPE_CHECKING:
    from dflashkit.kernels.cuda_graphs import Capture


class DFlashDrafter(nn.Module):
    """DFlash drafter. Trainable: layers, fc, hidden_norm, norm (and the mask vector, if learned)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # Saved apart from model.safetensors, as `mask_embedding.pt` (published convention).
        self.mask_embedding = nn.Parameter(torch.zeros(h)) if config.learned_mask_embedding else None
        vocab = torch.tensor(config.draft_vocab, dtype=torch.long) if config.draft_vocab is not None else None
        self.register_buffer("draft_vocab", vocab, persistent=False)  # [V'] or None
        self._head_rows: tuple[tuple, Callable[[Tensor], Tensor], int] | None = None  # see _draft_head
        self.fast = False  # see use_fast_path
        self.block_fill: str | None = None  # how a step fills its block short of the trained size (see block_plan)
        self.graphs = None  # GraphedDrafts when drafting steps replay CUDA graphs (see use_step_graphs)
        self.ngram_store: NgramStore | None = None  # drafts from the target's past answers (see ngram_store)
        # score the tokens of a generation's own text outside the draft vocabulary too (dflashkit.drafter.text_columns)
        self.text_columns = True
        self._in_vocab: tuple[Tensor, frozenset[int]] | None = None  # (draft_vocab, its token ids as a set)
        self._fast: tuple[tuple[int, int], FastDrafterForward] | None = None
        # (registrations() when taken, the parameters, how many times the list held other objects)
        self._params: tuple[int, list[nn.Parameter], int] | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def block_plan(self, k: int) -> tuple[int, int]:
        """How a step that scores k drafts runs its block: (drafts computed in a row after the anchor, the gap before
        one more row at the trained block's last position, 0: none). A block's rows attend to each other and the
        drafter trained on whole blocks only: cut short to k + 1 rows it drafts worse, and its last row is what it
        misses (docs/experiments.md: the first draft is accepted 13-32% more often from a whole block, and
        k + 1 rows plus that last row recover almost all of it). ``block_fill``: "whole" (block_size - 1 drafts),
        "tail" (k drafts and the last row), "cut" (k drafts); None (the default): "whole" on a GPU, where rows are
        free, and with CUDA-graph drafting (one shape), "tail" on a CPU."""
        last = self.config.block_size - 1  # the trained block's last offset
        fill = self.block_fill or ("whole" if self.fc.weight.device.type != "cpu" else "tail")
        if fill not in ("whole", "tail", "cut"):
            raise InvalidInputError(f"block_fill must be 'whole', 'tail', 'cut' or None, got {self.block_fill!r}")
        if k <= 0 or fill == "cut" or k >= last:
            return k, 0
        gap = last - k - 1  # 0: the last row is the next one, so the block is whole
        return (last, 0) if fill == "whole" or self.graphs is not None or gap == 0 else (k, gap)

    def context_key_values(self, target_features: Tensor, positions: Tensor) -> list[KV]:
        """Injected K/V of every layer for target features [batch, n, n_feat*hidden] at positions [n]."""
        ctx = self.hidden_norm(self.fc(target_features))  # [batch, n, hidden]
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.key_values(ctx, cos, sin) for layer in self.layers]

    def embed(self, token_ids: Tensor, embed_tokens: nn.Module) -> Tensor:
        """Drafter input embeddings [batch, n, hidden] of token_ids [batch, n] with the target's table.

        With a learned mask vector, it replaces the row of `mask_token_id` wherever that id occurs (the
        convention vLLM and llama.cpp follow for `mask_embedding.pt`).
        """
        emb = embed_tokens(token_ids).detach()  # the target's table is frozen: no gradient into it
        if self.mask_embedding is None:
            return emb
        is_mask = (token_ids == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(emb.dtype), emb)

    def new_context(self, capacity: int = 256, window: int | None = None) -> ContextCache:
        """An empty injected-context cache for one generation (with step graphs: of fixed capacity); drafting
        attends to its last ``window`` rows only (None: all). With a draft vocabulary (and ``text_columns`` on),
        drafting also scores the tokens of the generation's text outside it, as :meth:`ContextCache.note_text`
        reports them (:mod:`dflashkit.drafter.text_columns`)."""
        context = (
            self.graphs.new_context(capacity, window)
            if self.graphs is not None
            else ContextCache(len(self.layers), capacity, window)
        )
        if self.draft_vocab is not None and self.text_columns:
            if self._in_vocab is None or self._in_vocab[0] is not self.draft_vocab:
                self._in_vocab = (self.draft_vocab, frozenset(self.draft_vocab.tolist()))
            context.text = TextColumns(self.draft_vocab, self._in_vocab[1])
        return context

    def use_step_graphs(self, capture: Capture | None = None) -> None:
        """Replay drafting steps from graphs (:mod:`dflashkit.kernels.cuda_graphs`; needs the fast path). ``capture``
        None: CUDA graphs (a CUDA device); another capture function stands in for them, e.g. in tests."""
        from dflashkit.drafter.cuda_graphs import GraphedDrafts

        if not self.fast:
            raise InvalidInputError("drafting step graphs need the drafter's fast path (use_fast_path())")
        self.graphs = GraphedDrafts(self, capture)

    @torch.inference_mode()
    def draft_scores(
        self,
        context: ContextCache,
        new_features: Tensor | None,
        new_start: int,
        anchor: int,
        pos: int,
        k: int,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
    ) -> tuple[Tensor, Tensor | None]:
        """One drafting step over the draft vocabulary: logits [k, V'] and the token id of each column [V']
        (None: no draft vocabulary, the columns are the whole vocabulary). Row j predicts the token at position
        pos+1+j. Proposing from these (argmax, or sampling over V' columns) skips the [k, vocab] scatter.

        new_features [1, n, n_feat*hidden]: verified target features at positions new_start.. not yet
        in `context`; they are appended first (the context grows only by verified tokens). Where the context keeps
        its text's tokens outside the draft vocabulary (:attr:`ContextCache.text`), they follow as more columns.
        """
        device = self.fc.weight.device
        fast = self._fast_forward() if self.fast else None
        vocab_head = lm_head if self.draft_vocab is None else self._draft_head(lm_head)[0]
        text = context.text if self.draft_vocab is not None else None
        columns = text.columns() if text is not None else self.draft_vocab  # [V' (+ E)] or None

        def head(hidden: Tensor, scores: Tensor | None = None) -> Tensor:  # [rows, hidden] -> [rows, V' (+ E)]
            scores = vocab_head(hidden) if scores is None else scores  # [rows, V'] (a graph's are given)
            return text.scores(hidden, scores, lm_head, vocab_head) if text is not None else scores

        step = DraftStep(context, new_features, new_start, anchor, pos, *self.block_plan(k))
        drafted, gap = step.k, step.gap  # the block: drafts computed in a row [+ the trained block's last row]
        if fast is not None and self.graphs is None and fast.can_step(context, embed_tokens, new_features):
            # context rows always go through this call, however many arrive at once (a prompt's too), so that a
            # row's keys and values do not depend on the steps that brought it
            if step.rows + 1 <= fast.row_limit:
                hidden = fast.step([step], embed_tokens.weight)  # [step.rows, hidden]
                return head(hidden[:k]), columns  # [k, V' (+ E)]
            fast.step([DraftStep(context, new_features, new_start, anchor, pos, 0)], embed_tokens.weight)
            new_features = None
        if new_features is not None and new_features.shape[1]:
            self._append_context(context, new_features, new_start, fast)

        def eager(scored: int = k) -> Tensor:  # hidden rows of the block's first `scored` drafts [scored, hidden]
            tail = [pos + drafted + 1 + gap] if gap else []
            block_ids = torch.full((1, step.rows + 1), self.config.mask_token_id, device=device)
            block_ids[0, 0] = anchor
            run = fast if fast is not None else self
            positions = torch.tensor(list(range(pos, pos + drafted + 1)) + tail, device=device)
            embeddings = self.embed(block_ids, embed_tokens)
            return run(embeddings, positions, context.layers())[0, 1 : scored + 1]

        if self.graphs is not None and fast is not None:  # graphs of whole blocks: one shape for every k

            def whole() -> tuple[Tensor, Tensor]:
                hidden = eager(drafted)
                return vocab_head(hidden), hidden

            vocab_scores, hidden = self.graphs(context, anchor, pos, drafted, embed_tokens, vocab_head, fast, whole)
            scores = head(hidden[:k], vocab_scores[:k])
        else:
            scores = head(eager())
        return scores, columns  # [k, V' (+ E)] over the columns' tokens (None: [k, vocab])

    @torch.inference_mode()
    def draft_scores_batch(self, calls: list[tuple]) -> list[tuple[Tensor, Tensor | None]]:
        """:meth:`draft_scores` for several sequences (each call: its arguments, in order): in one C++ call and one
        head product where the kernels run them all (:meth:`FastDrafterForward.step`), else one after another.
        Each sequence's scores are bitwise those of its call alone."""
        fast = self._fast_forward() if self.fast and self.graphs is None and len(calls) > 1 else None
        wanted = [c[5] for c in calls]  # drafts scored per call; each block as block_plan says
        steps = [DraftStep(*c[:5], *self.block_plan(c[5])) for c in calls]
        embed_tokens, lm_head = calls[0][6], calls[0][7]
        if (
            fast is not None
            and all(c[6] is embed_tokens and c[7] is lm_head for c in calls)
            and all(
                0 < d.k and d.rows + 1 <= fast.row_limit and fast.can_step(d.context, embed_tokens, d.new_features)
                for d in steps
            )
            and len({id(d.context) for d in steps}) == len(steps)
        ):
            head = lm_head if self.draft_vocab is None else self._draft_head(lm_head)[0]
            before = [(d.context.length, d.context.stored_from) for d in steps]
            try:
                hidden = fast.step(steps, embed_tokens.weight)  # [sum of block rows, hidden]
                hidden = torch.cat([part[:k] for part, k in zip(hidden.split([d.rows for d in steps]), wanted)])
                limit = row_kernels.max_batch_rows()  # the head's rows stay on the kernel they take alone
                scores = torch.cat([head(part) for part in hidden.split(limit)])  # [sum of k, V']
            except BaseException:  # the contexts as they were, so that the calls can be run again one by one
                for d, (length, stored_from) in zip(steps, before):
                    d.context.length, d.context.stored_from = length, stored_from
                raise
            results = []
            for d, rows, own in zip(steps, scores.split(wanted), hidden.split(wanted)):
                text = d.context.text if self.draft_vocab is not None else None
                if text is not None:  # its text's own columns after the draft vocabulary's
                    rows = text.scores(own, rows, lm_head, head)
                results.append((rows, text.columns() if text is not None else self.draft_vocab))
            return results
        return [self.draft_scores(*c) for c in calls]

    def _append_context(
        self, context: ContextCache, new_features: Tensor, new_start: int, fast: FastDrafterForward | None
    ) -> None:
        """Project verified target features [1, n, F] at positions new_start.. into the context's K/V rows."""
        n = new_features.shape[1]
        skip = context.outside_window(n)  # rows the window has passed already: not computed
        positions = torch.arange(new_start + skip, new_start + n, device=new_features.device)
        kv = fast.context_key_values if fast is not None else self.context_key_values
        context.append(kv(new_features[:, skip:], positions), skipped=skip)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the inference caches out (packed oneDNN tensors cannot be copied); they are
        rebuilt on first use."""
        state = super().__getstate__().copy()
        state["_fast"], state["_head_rows"], state["graphs"], state["_params"] = None, None, None, None
        return state

    def use_fast_path(self, on: bool = True) -> None:
        """Draft through :class:`FastDrafterForward` (fused prepacked products, plain callables; rebuilt when the
        parameters change) or through the modules (the eager path). Training always uses the modules."""
        self.fast = on
        self._fast = None

    def _fast_forward(self) -> FastDrafterForward:
        """The fast forward of the parameters as they are now: rebuilt when one was updated in place (its version)
        or replaced. The parameter list is kept between calls (walking the module tree each drafting step cost
        ~0.2 ms once the target's pass had evicted it from the caches) and taken again after any parameter was
        registered anywhere; only a list that then holds other objects counts as replaced parameters (a parameter
        registered elsewhere, by any module made while decoding, costs a new list, not a new fast forward)."""
        if self._params is None or self._params[0] != registrations():
            params = list(self.parameters())
            same = (
                self._params is not None
                and len(params) == len(self._params[1])
                and all(a is b for a, b in zip(params, self._params[1]))
            )
            self._params = (registrations(), params, self._params[2] + (not same) if self._params is not None else 0)
        version = (self._params[2], sum(p._version for p in self._params[1] if not p.is_inference()))
        if self._fast is None or self._fast[0] != version:
            self._fast = (version, FastDrafterForward(self))
        return self._fast[1]

    def logits(self, hidden: Tensor, lm_head: nn.Module) -> Tensor:
        """Vocabulary logits [..., vocab] of drafter hidden states; outside the draft vocabulary, -inf."""
        if self.draft_vocab is None:
            return lm_head(hidden)
        head, _ = self._draft_head(lm_head)
        return self._scatter(head(hidden), self.draft_vocab, lm_head)  # only the draft vocabulary's rows are read

    def _scatter(self, sub: Tensor, token_ids: Tensor, lm_head: nn.Module) -> Tensor:
        """Draft-vocabulary logits [..., V'] placed in a [..., vocab] row of -inf."""
        _, vocab = self._draft_head(lm_head)
        full = sub.new_full((*sub.shape[:-1], vocab), float("-inf"))
        return full.index_copy_(-1, token_ids.to(sub.device), sub)

    def _draft_head(self, lm_head: nn.Module) -> tuple[Callable[[Tensor], Tensor], int]:
        """The target's head restricted to the draft vocabulary's rows, and the full vocabulary size; rebuilt
        only when the head (or its weights) change. A weight-only quantized head keeps its rows quantized; other
        heads' rows are prepacked for oneDNN where that runs (:mod:`dflashkit.kernels.linear`)."""
        weight = (  # [vocab, hidden]
            lm_head.qweight
            if isinstance(lm_head, Int8Linear)
            else lm_head.codes
            if isinstance(lm_head, Int4Linear)
            else lm_head.weight
        )
        key = (id(lm_head), weight.data_ptr(), weight._version)
        if self._head_rows is None or self._head_rows[0] != key:
            ids = self.draft_vocab.to(weight.device)
            if isinstance(lm_head, WEIGHT_ONLY):
                head = lm_head.rows(ids)
            else:
                head = PackedLinear(weight[ids].detach())  # [V', hidden] rows
            self._head_rows = (key, head, weight.shape[0])
        return self._head_rows[1], self._head_rows[2]

    def forward(
        self,
        block_embeddings: Tensor,
        positions: Tensor,
        context: list[KV],
        attn_mask: Tensor | BlockMask | None = None,
    ) -> Tensor:
        """Final-normed hidden states [batch, q_len, hidden] of the block tokens.

        block_embeddings (see `embed`) [batch, q_len, hidden] at absolute positions [q_len] (or [batch, q_len]);
        context: per-layer injected K/V; attn_mask (training): bool [batch, 1, q_len, ctx+q_len], or a BlockMask.
        """
        cos, sin = self.rotary(positions, block_embeddings.dtype)
        h = block_embeddings
        for layer, ctx in zip(self.layers, context):
            h = layer(h, cos, sin, ctx, attn_mask)
        return self.norm(h)
