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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashkit.kernels import row_kernels
from dflashkit.kernels import ops as kernels
from dflashkit.drafter.config import DrafterConfig, check_context_window
from dflashkit.errors import InvalidInputError
from dflashkit.kernels.ops import Matmul, rotate, signed_sin
from dflashkit.kernels.linear import PackedLinear
from dflashkit.drafter.ngram_store import NgramStore
from dflashkit.kernels.int8 import Int8Linear
from dflashkit.drafter.text_columns import TextColumns

if TYPE_CHECKING:
    from dflashkit.kernels.cuda_graphs import Capture

KV = tuple[Tensor, Tensor]  # keys, values: [batch, kv_heads, seq, head_dim] each

# Parameters registered on any module since this import: a drafter's cached parameter list (see _fast_forward) is
# taken again when it changes, since one of its parameters may have been replaced rather than updated in place.
_registrations = 0


def _count_registration(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


@dataclass(frozen=True)
class BlockMask:
    """Training attention for N blocks of `block_size` queries, computed block-sparsely: a query of block n
    sees the context keys that `context` [batch, N*B, ctx_len] allows and all B keys of block n, nothing
    else (equal to the dense mask of train.training_attention_mask for real blocks, without its
    (N*B)^2 cross-block work)."""

    context: Tensor
    block_size: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Plain RoPE on absolute positions (rotate-half convention, as Qwen3/Llama in transformers)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., seq, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., seq, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim] or [batch, seq, head_dim]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [batch, heads, seq, head_dim]

    def key_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """Keys (k_norm + RoPE) and values of hidden states x [batch, seq, hidden]."""
        k = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), cos, sin)
        v = self._heads(self.v_proj(x), self.n_kv)
        return k, v

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, context: KV, attn_mask: Tensor | BlockMask | None = None
    ) -> Tensor:
        """x: block hidden states [batch, q_len, hidden]; context: injected K/V; mask: bool [.., q, ctx+q]."""
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), cos, sin)
        k_blk, v_blk = self.key_values(x, cos, sin)
        if isinstance(attn_mask, BlockMask):
            return self._block_sparse(q, k_blk, v_blk, context, attn_mask)
        k = torch.cat((context[0], k_blk), dim=2)  # [batch, kv_heads, ctx+q_len, head_dim]
        v = torch.cat((context[1], v_blk), dim=2)
        b, h, s, d = q.shape
        if attn_mask is None:  # inference: the block sees everything; query heads packed per K/V head, no copy
            packed = q.reshape(b, self.n_kv, (h // self.n_kv) * s, d)  # [batch, kv_heads, group*q_len, head_dim]
            out = F.scaled_dot_product_attention(packed, k, v).reshape(b, h, s, d)
        else:
            if self.n_kv != h:
                k, v = k.repeat_interleave(h // self.n_kv, dim=1), v.repeat_interleave(h // self.n_kv, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h * d))

    def _block_sparse(self, q: Tensor, k_blk: Tensor, v_blk: Tensor, context: KV, mask: BlockMask) -> Tensor:
        """Training attention; query heads grouped by their K/V head ([S, kv, group, ...]) so K/V are never copied."""
        S, h, Q, d = q.shape
        B, kv = mask.block_size, self.n_kv
        N, group = Q // B, h // kv
        k_ctx, v_ctx = context  # [S, kv, ctx, d]
        ctx_len = k_ctx.shape[2]
        scale = d**-0.5
        qg = q.reshape(S, kv, group * Q, d)
        s_ctx = (qg @ k_ctx.transpose(-1, -2)) * scale  # [S, kv, group*Q, ctx]
        s_ctx = s_ctx.view(S, kv, group, Q, ctx_len).masked_fill(~mask.context[:, None, None], float("-inf"))
        qb = q.reshape(S, kv, group, N, B, d)
        kb, vb = k_blk.view(S, kv, 1, N, B, d), v_blk.view(S, kv, 1, N, B, d)
        s_blk = (qb @ kb.transpose(-1, -2)) * scale  # [S, kv, group, N, B, B]: own block only
        scores = torch.cat((s_ctx.view(S, kv, group, N, B, ctx_len), s_blk), dim=-1)
        p = scores.float().softmax(-1).to(q.dtype)  # never empty: own block
        out_ctx = p[..., :ctx_len].reshape(S, kv, group * Q, ctx_len) @ v_ctx  # [S, kv, group*Q, d]
        out_blk = p[..., ctx_len:] @ vb  # [S, kv, group, N, B, d]
        out = out_ctx.view(S, h, Q, d) + out_blk.reshape(S, h, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(S, Q, h * d))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, context: KV, attn_mask: Tensor | BlockMask | None = None
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        # (_registrations when taken, the parameters, how many times the list held other objects)
        self._params: tuple[int, list[nn.Parameter], int] | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def block_plan(self, k: int) -> tuple[int, int]:
        """How a step that scores k drafts runs its block: (drafts computed in a row after the anchor, the gap before
        one more row at the trained block's last position, 0: none). A block's rows attend to each other and the
        drafter trained on whole blocks only: cut short to k + 1 rows it drafts worse, and its last row is what it
        misses (README "Whole drafter blocks": the first draft is accepted 13-32% more often from a whole block, and
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
        context = (self.graphs.new_context(capacity, window) if self.graphs is not None
                   else ContextCache(len(self.layers), capacity, window))
        if self.draft_vocab is not None and self.text_columns:
            if self._in_vocab is None or self._in_vocab[0] is not self.draft_vocab:
                self._in_vocab = (self.draft_vocab, frozenset(self.draft_vocab.tolist()))
            context.text = TextColumns(self.draft_vocab, self._in_vocab[1])
        return context

    def use_step_graphs(self, capture: Capture | None = None) -> None:
        """Replay drafting steps from graphs (:mod:`dflashkit.kernels.cuda_graphs`; needs the fast path). ``capture``
        None: CUDA graphs (a CUDA device); another capture function stands in for them, e.g. in tests."""
        from dflashkit.kernels.cuda_graphs import GraphedDrafts

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
        if fast is not None \
                and all(c[6] is embed_tokens and c[7] is lm_head for c in calls) \
                and all(0 < d.k and d.rows + 1 <= fast.row_limit and fast.can_step(d.context, embed_tokens, d.new_features)
                        for d in steps) \
                and len({id(d.context) for d in steps}) == len(steps):
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

    def _append_context(self, context: ContextCache, new_features: Tensor, new_start: int,
                        fast: FastDrafterForward | None) -> None:
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
        if self._params is None or self._params[0] != _registrations:
            params = list(self.parameters())
            same = self._params is not None and len(params) == len(self._params[1]) \
                and all(a is b for a, b in zip(params, self._params[1]))
            self._params = (_registrations, params, self._params[2] + (not same) if self._params is not None else 0)
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
        only when the head (or its weights) change. A weight-only int8 head keeps its rows in int8; other
        heads' rows are prepacked for oneDNN where that runs (:mod:`dflashkit.kernels.linear`)."""
        weight = lm_head.qweight if isinstance(lm_head, Int8Linear) else lm_head.weight  # [vocab, hidden]
        key = (id(lm_head), weight.data_ptr(), weight._version)
        if self._head_rows is None or self._head_rows[0] != key:
            ids = self.draft_vocab.to(weight.device)
            if isinstance(lm_head, Int8Linear):
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


@dataclass
class DraftStep:
    """One sequence's drafting step (see :meth:`DFlashDrafter.draft_scores`): its context cache, its verified target
    features not yet in it ([1, n, F] at positions ``new_start``.., or None), the anchor token at ``pos``, the
    k drafts to compute after it and the gap before a last row (see :meth:`DFlashDrafter.block_plan`)."""

    context: ContextCache
    new_features: Tensor | None
    new_start: int
    anchor: int
    pos: int
    k: int
    gap: int = 0  # > 0: one more row after the k drafts, this many positions further (the trained block's last row)

    @property
    def rows(self) -> int:
        """Block rows after the anchor: the k drafts, and the last row where there is a gap."""
        return self.k + (self.gap > 0)


class FastDrafterForward:
    """The drafter's inference forward (batch 1, no mask) on plain callables: q/k/v and gate/up fused into one
    product each, every product prepacked for oneDNN (:mod:`dflashkit.kernels.ops`). Same maths as the modules;
    built from the drafter's parameters as they are now."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        first = drafter.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.n_heads, first.n_kv, first.head_dim
        self.fc = Matmul.of(drafter.fc)
        self.hidden_norm, self.norm = _plain(drafter.hidden_norm), _plain(drafter.norm)
        self.rotary = drafter.rotary
        self.layers = [_FastDrafterLayer(layer) for layer in drafter.layers]
        attns = [layer.self_attn for layer in drafter.layers]
        # the injected context's keys and values of every layer in one product: [k_0 v_0 k_1 v_1 ...] rows
        self.context_kv = Matmul.fused([proj for a in attns for proj in (a.k_proj, a.v_proj)])
        # every layer's k_norm in one call: its weight per (layer, kv head) row of the context's keys
        self.context_k_norm = _per_head_norm([(a.k_norm, self.kv_heads) for a in attns])
        self.fused_weights = self._fused_weights(drafter)
        self.row_limit = row_kernels.max_rows(self.fc.weight.device)  # blocks of more rows: the Python layers
        # the one-call step (row_kernels.drafter_step_batch): the context's products and norms, the final norm
        self.step_weights = None
        if self.fused_weights is not None and self.fc.small is not None and self.context_kv.small is not None:
            self.step_weights = (self.fc.small, self.hidden_norm.weight, self.hidden_norm.eps, self.context_kv.small,
                                 self.norm.weight, self.norm.eps)
        self.mask_token_id = drafter.config.mask_token_id
        self.learned_mask = drafter.mask_embedding.detach() if drafter.mask_embedding is not None else None
        self._mask_row: tuple[tuple, Tensor] | None = None  # (the embedding table it was taken from, [H])
        self._rotary: tuple[Tensor, Tensor] | None = None  # cos, signed sin [P, head_dim] for positions 0..P-1

    def _fused_weights(self, drafter: DFlashDrafter) -> list[Tensor] | None:
        """The layer tensors of the one-call step (8 per layer, as ``row_kernels.decoder_layers`` takes them) where its
        kernels run, else None."""
        layers = drafter.layers
        eps = {norm.eps for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                                         layer.self_attn.q_norm, layer.self_attn.k_norm)}
        fast = self.layers
        if len(eps) != 1 or not row_kernels.attention_usable(self.fc.weight.dtype, self.fc.weight.device,
                                                             self.head_dim) \
                or any(getattr(m, "small", None) is None for f in fast for m in (f.qkv, f.o, f.gate_up, f.down)):
            return None
        self.eps = eps.pop()
        weights = []
        for layer, f in zip(layers, fast):
            weights += row_kernels.layer_weights(f.input_norm.weight, f.qkv.small, None, f.o.small, f.post_norm.weight,
                                                 f.gate_up.small, f.down.small, layer.self_attn.q_norm.weight,
                                                 layer.self_attn.k_norm.weight)
        return weights

    def can_step(self, context: object, embed_tokens: nn.Module, new_features: Tensor | None = None) -> bool:
        """Whether :meth:`step` runs drafting steps here: the kernels run the drafter, the context is a plain
        :class:`ContextCache`, the features are bf16 and the target's embedding table is a bf16 [V, hidden] CPU table.
        (Blocks of more than ``row_limit`` rows run the Python layers after it has taken their context rows.)"""
        weight = getattr(embed_tokens, "weight", None)
        return (self.step_weights is not None and self.fused_weights is not None
                and isinstance(context, ContextCache)
                and (new_features is None or new_features.dtype == torch.bfloat16)
                and isinstance(weight, Tensor) and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.shape[1] == self.hidden_norm.weight.shape[0]
                and weight.is_contiguous())

    def step(self, drafts: list[DraftStep], embed: Tensor) -> Tensor:
        """Drafting steps of several sequences in one C++ call (:func:`row_kernels.drafter_step_batch`; each one
        :meth:`can_step`, its block at most ``row_limit`` rows): their new features enter their contexts, their
        blocks run through every layer (k = 0: no block, the context rows only). Returns the final-normed hidden
        rows of every step's k drafts (and its last row, where it has a gap), in order [sum of rows, hidden]."""
        features, writes, feature_positions, anchors, counts, positions, caches, starts, firsts, gaps = (
            [] for _ in range(10))
        taken = []
        empty = embed.new_empty(0)
        for d in drafts:
            context, n = d.context, d.new_features.shape[1] if d.new_features is not None else 0
            skip = context.outside_window(n)  # rows the window has passed already: not computed
            block = d.rows + 1 if d.k > 0 else 0
            writes.append(context.prepare(n, skip, block, self.kv_heads, self.head_dim, embed.dtype, embed.device))
            features.append(d.new_features[0, skip:] if n > skip else empty)
            feature_positions.append(d.new_start + skip)
            taken.append((context, n, skip))
            length = context.length + n  # the context's length once these rows are in: the block starts there
            starts.append(length)
            firsts.append(0 if context.window is None else max(0, length - context.window))
            anchors.append(-1 if self.learned_mask is not None and d.anchor == self.mask_token_id else d.anchor)
            counts.append(block)
            positions.append(d.pos)
            gaps.append(d.gap if block else 0)
            caches.append((context.keys, context.values))
        end = max(max(p + c + g for p, c, g in zip(positions, counts, gaps)),
                  max(p + (f.shape[0] if f.numel() else 0) for p, f in zip(feature_positions, features)))
        hidden = row_kernels.drafter_step_batch(
            features, self.step_weights, writes, feature_positions, embed, self.mask_row(embed), anchors, counts,
            positions, gaps, self.rotary_rows(end, embed.dtype, embed.device), self.fused_weights, caches, starts, firsts,
            self.heads, self.kv_heads, self.layers[0].intermediate, self.eps, self.head_dim**-0.5)
        for context, n, skip in taken:
            context.commit(n, skip)
        return hidden

    def mask_row(self, embed: Tensor) -> Tensor:
        """The block's mask row [hidden]: the learned mask vector, or the mask token's row of the embedding table."""
        key = (embed.data_ptr(), embed.shape)
        if self._mask_row is None or self._mask_row[0] != key:
            row = self.learned_mask if self.learned_mask is not None else embed[self.mask_token_id]
            self._mask_row = (key, row.to(embed.dtype).contiguous())
        return self._mask_row[1]

    def rotary_rows(self, positions: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and signed sin tables covering positions 0..positions-1 (grown by doubling, kept between steps)."""
        if self._rotary is None or self._rotary[0].shape[0] < positions or self._rotary[0].dtype != dtype:
            size = max(256, 1 << (positions - 1).bit_length())
            cos, sin = self.rotary_tables(size, dtype, device)
            self._rotary = (cos.contiguous(), sin.contiguous())
        return self._rotary

    def context_key_values(self, target_features: Tensor, positions: Tensor) -> list[KV]:
        ctx = self.hidden_norm(self.fc(target_features))  # [1, n, hidden]
        cos, sin = self.rotary(positions, ctx.dtype)
        sin = signed_sin(sin)
        n, kv, d, layers = ctx.shape[1], self.kv_heads, self.head_dim, len(self.layers)
        kvs = self.context_kv(ctx).view(1, n, layers, 2, kv, d)  # every layer's keys and values, one product
        k = self.context_k_norm(kvs[:, :, :, 0].reshape(1, n, layers * kv, d))  # [1, n, layers*kv_heads, d]
        k = rotate(k.transpose(1, 2), cos, sin)  # [1, layers*kv_heads, n, d]
        v = kvs[:, :, :, 1].transpose(1, 3)  # [1, kv_heads, layers, n, d]
        return [(k[:, i * kv : (i + 1) * kv], v[:, :, i]) for i in range(layers)]

    def __call__(self, block_embeddings: Tensor, positions: Tensor, context: list[KV]) -> Tensor:
        """Final-normed hidden states [1, q_len, hidden] of the block (see DFlashDrafter.forward)."""
        cos, sin = self.rotary(positions, block_embeddings.dtype)
        return self.run(block_embeddings, cos, signed_sin(sin), context)

    def rotary_tables(self, positions: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and signed sin [positions, head_dim] of positions 0..positions-1 (row p = what a step at p uses)."""
        cos, sin = self.rotary(torch.arange(positions, device=device), dtype)
        return cos, signed_sin(sin)

    def run(self, block_embeddings: Tensor, cos: Tensor, sin: Tensor, context: list[KV],
            mask: Tensor | None = None) -> Tensor:
        """The layers over the block [1, s, hidden] with rotary cos and signed sin [s, head_dim]; ``mask``
        (additive, [1, 1, group*s, ctx+s]) hides context rows, None: every context row is valid."""
        h, (heads, kv, d) = block_embeddings, (self.heads, self.kv_heads, self.head_dim)
        s = h.shape[1]
        for layer, (k_ctx, v_ctx) in zip(self.layers, context):
            qkv = layer.qkv(layer.input_norm(h))  # [1, s, (heads + 2*kv_heads) * d]
            # q_norm and k_norm in one call (a weight per head row), then one rotation of queries and keys
            qk = layer.qk_norm(qkv[..., : (heads + kv) * d].view(1, s, heads + kv, d))
            qk = rotate(qk.transpose(1, 2), cos, sin)  # [1, heads + kv_heads, s, d]
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[..., (heads + kv) * d :]
            keys = torch.cat((k_ctx, k), dim=2)  # [1, kv_heads, ctx+s, d]
            values = torch.cat((v_ctx, v.view(1, s, kv, d).transpose(1, 2)), dim=2)
            packed = q.reshape(1, kv, (heads // kv) * s, d)  # query heads per K/V head, no K/V copy
            out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask).reshape(1, heads, s, d)
            h = h + layer.o(out.transpose(1, 2).reshape(1, s, heads * d))
            gate_up = layer.gate_up(layer.post_norm(h))
            h = h + layer.down(F.silu(gate_up[..., : layer.intermediate]) * gate_up[..., layer.intermediate :])
        return self.norm(h)


class _FastDrafterLayer:
    def __init__(self, layer: DrafterLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Matmul.fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = Matmul.of(attn.o_proj)
        self.gate_up = Matmul.fused([mlp.gate_proj, mlp.up_proj])
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.down = Matmul.of(mlp.down_proj)
        self.input_norm, self.post_norm = _plain(layer.input_layernorm), _plain(layer.post_attention_layernorm)
        self.qk_norm = _per_head_norm([(attn.q_norm, attn.n_heads), (attn.k_norm, attn.n_kv)])


def _plain(norm: RMSNorm) -> kernels.RMSNorm:
    return kernels.RMSNorm(norm.weight, norm.eps)


def _per_head_norm(norms: list[tuple[RMSNorm, int]]) -> kernels.RMSNorm:
    """Several per-head RMS norms as one call over stacked heads: norm i's weight repeated for its `count` head
    rows ([sum of counts, head_dim]), so x [..., sum of counts, head_dim] is normed head by head."""
    if len({norm.eps for norm, _ in norms}) != 1:
        raise ValueError("per-head norms with different eps cannot be stacked")
    weight = torch.cat([norm.weight.detach()[None].expand(count, -1) for norm, count in norms])
    return kernels.RMSNorm(weight, norms[0][0].eps)


class ContextCache:
    """Injected context K/V of every drafter layer, grown only by verified tokens.

    Buffers are preallocated (``keys`` and ``values`` [layers, kv_heads, capacity, head_dim]; per layer views
    [1, kv_heads, capacity, head_dim]) and grown by doubling, so appending costs a copy of the new rows only.
    Rows past ``length`` are scratch: the one-call drafter layers (dflashkit.kernels.row_kernels) write a block's own
    keys and values there. With a ``window``, drafting attends to the last ``window`` rows only (:attr:`first`
    on); rows the window had already passed when they arrived are not computed at all (:meth:`outside_window`).
    """

    def __init__(self, num_layers: int, capacity: int = 256, window: int | None = None) -> None:
        self.num_layers = num_layers
        self.capacity = capacity
        self.window = check_context_window(window)
        self.length = 0
        self.stored_from = 0  # rows before it were skipped (outside the window), never computed
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self._buffers: list[tuple[Tensor, Tensor]] | None = None
        self.text: TextColumns | None = None  # the text's tokens outside the draft vocabulary (set by new_context)

    def note_text(self, token_ids: list[int]) -> None:
        """Report tokens of the generation's text (its prompt, then what it emits), so that drafting can propose
        those outside the draft vocabulary too (:mod:`dflashkit.drafter.text_columns`); nothing without one."""
        if self.text is not None:
            self.text.add(token_ids)

    def outside_window(self, n: int) -> int:
        """How many of the next n rows drafting will never attend to (they fall before the window once all n are
        in): their keys and values need not be computed."""
        return 0 if self.window is None else max(0, n - self.window)

    def append(self, kvs: list[KV], skipped: int = 0) -> None:
        """Append rows: ``skipped`` rows that were not computed (see :meth:`outside_window`; their buffer rows are
        left as they are and never read), then the rows of ``kvs``."""
        like = kvs[0][0]  # [1, kv_heads, rows, head_dim]
        n = skipped + like.shape[2]
        start = self.prepare(n, skipped, 0, like.shape[1], like.shape[3], like.dtype, like.device)
        for (kb, vb), (k, v) in zip(self._buffers, kvs):
            kb[:, :, start : self.length + n] = k
            vb[:, :, start : self.length + n] = v
        self.commit(n, skipped)

    def prepare(self, n: int, skipped: int, scratch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> int:
        """Room for n more rows (the first ``skipped`` of them not computed) and ``scratch`` rows past them; returns
        the buffer row where the computed rows go. They count once :meth:`commit` is called."""
        if skipped and skipped > self.outside_window(n):
            raise InvalidInputError(f"{skipped} of {n} rows skipped, but only {self.outside_window(n)} fall outside "
                                    "the context window")
        end = self.length + n + scratch
        if self._buffers is None:
            self._allocate((1, kv_heads, 0, head_dim), dtype, device, max(self.capacity, end))
        elif end > self._buffers[0][0].shape[2]:
            self.reserve(end)
        return self.length + skipped

    def commit(self, n: int, skipped: int = 0) -> None:
        """Count the n rows :meth:`prepare` made room for (and its buffer rows then written) as context."""
        start = self.length + skipped
        self.length += n
        if skipped:
            self.stored_from = start

    def reserve(self, end: int) -> None:
        """Room for rows < end (the buffers double when they would not fit)."""
        assert self.keys is not None, "context cache is empty"
        if end > self.keys.shape[2]:
            keys, values = self.keys, self.values
            self._allocate(keys[0:1].shape, keys.dtype, keys.device, max(2 * keys.shape[2], end))
            self.keys[:, :, : self.length] = keys[:, :, : self.length]
            self.values[:, :, : self.length] = values[:, :, : self.length]

    @property
    def first(self) -> int:
        """The first row a drafting step attends to: 0, or where the window of the last ``window`` rows starts."""
        return 0 if self.window is None else max(0, self.length - self.window)

    def layers(self) -> list[KV]:
        """Views of the rows drafting attends to (all, or the window): per layer (keys, values)
        [1, kv_heads, length - first, head_dim]."""
        assert self._buffers is not None, "context cache is empty"
        first = self.first
        return [(k[:, :, first : self.length], v[:, :, first : self.length]) for k, v in self._buffers]

    def crop(self, length: int) -> None:
        length = min(self.length, length)
        if self.window is not None and max(0, length - self.window) < self.stored_from:
            raise InvalidInputError("cannot crop a windowed context back into rows that were skipped")
        self.length = length

    def _allocate(self, like: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device,
                  capacity: int) -> None:
        """New buffers of the shape `like` [1, kv_heads, *, head_dim] for every layer."""
        shape = (self.num_layers, like[1], capacity, like[3])
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self._buffers = [(self.keys[i : i + 1], self.values[i : i + 1]) for i in range(self.num_layers)]
