"""A compact decoding forward for Llama-family targets: fused prepacked GEMMs and a preallocated KV cache.

transformers' forward is general: per layer it builds masks, walks cache objects, calls ~20 small modules
and runs q/k/v and gate/up as separate GEMMs. On a 2-core CPU that generality costs as much as the
arithmetic of a 135M model (SmolLM2-135M, bf16, 2 threads: this forward takes a one-token step in under half
the time of transformers' eager forward, and a 16-token verify pass in about 70%).

:class:`FastTargetForward` reads the weights of an ordinary ``AutoModelForCausalLM`` through its modules
(``model.get_decoder().layers[i].self_attn.q_proj.weight``, ...), fuses q/k/v and gate/up into one matrix
each, prepacks every matrix for oneDNN (:mod:`dflashkit.kernels.linear`), and runs a plain forward over a
:class:`StaticKVCache` (one preallocated buffer per layer for keys and values; a rejection only moves
the length back). Rotary embeddings come from the model's own rotary module, so every rope type the model
supports is computed as transformers computes it. Hidden states of the feature layers are the residual
stream after those layers, exactly what hooks on the decoder layers capture.

It covers the architectures whose layers are pre-norm RMSNorm + grouped-query attention (optionally with
q/k/v biases, as Qwen2, or per-head q/k RMSNorm, as Qwen3) + SwiGLU MLP: ``llama`` (SmolLM2), ``mistral``
without sliding windows, ``qwen2``, ``qwen3``. :func:`unsupported_reason` says why another model is not
covered; the adapter then keeps transformers' forward. Weight-only int8 targets (:mod:`dflashkit.kernels.int8`)
are covered too: their products stay int8 (fused rows keep their own scales). The numbers are the model's
up to float rounding (fused GEMMs and the attention kernel may round differently from transformers' path);
both the plain and the speculative decode loop run through the same forward, so losslessness is unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels
from dflashkit.kernels.linear import PackedLinear, packing_supported
from dflashkit.kernels.ops import Matmul, RMSNorm, rotate, signed_sin
from dflashkit.kernels.quantize import WEIGHT_ONLY

# attention of packed queries [1, kv_heads, group*n, d] over keys and values [1, kv_heads, m, d], with a scale
Attend = Callable[[Tensor, Tensor, Tensor, float], Tensor]


def masked_sdpa(q: Tensor, keys: Tensor, values: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why :class:`FastTargetForward` cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in ARCHITECTURES:
        return f"architecture {cfg.model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (only silu)"
    if (
        getattr(cfg, "use_sliding_window", False)
        or (cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None))
        or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ())
    ):
        return "sliding-window attention"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    decoder = model.get_decoder()
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "norm") or not hasattr(decoder, "layers"):
        return "its decoder has no rotary_emb / norm / layers"
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if (
            attn is None
            or mlp is None
            or not all(hasattr(attn, n) for n in names)
            or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        ):
            return "a decoder layer without the usual q/k/v/o and gate/up/down projections"
        if not all(isinstance(getattr(attn, n), (nn.Linear, PackedLinear, *WEIGHT_ONLY)) for n in names):
            return "projections that are not plain (or dflashkit quantized) linear layers"
        if not hasattr(attn, "scaling") or not hasattr(attn, "head_dim"):
            return "attention without `scaling` / `head_dim`"
    return None


class StaticKVCache:
    """Keys and values of every target layer in preallocated buffers [layers, kv_heads, capacity, head_dim].

    Positions < ``length`` are valid. Writing at ``start`` sets the length to ``start + n``: a rejected draft
    is dropped by :meth:`crop` (the length moves back; the stale rows are overwritten later). The buffers
    double when a write would not fit.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_layers, kv_heads, max(1, capacity), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, end: int) -> None:
        """Make room for positions < end (doubling the buffers when needed)."""
        if end > self.capacity:
            grown = max(end, 2 * self.capacity)
            keys = self.keys.new_zeros(*self.keys.shape[:2], grown, self.keys.shape[3])
            values = self.values.new_zeros(keys.shape)
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = keys, values

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(0, length))

    @torch.inference_mode()  # the buffers may be inference tensors (grown inside the forward)
    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Keep, of the positions written from `start`, the rows `rows` (increasing, relative to start), moved
        to start, start+1, ...; the length becomes start + len(rows). Used after a token tree's verify pass:
        the accepted path's keys and values become the next positions (their rotary phase is already right:
        a node at depth d was run at position start + d, where it now lies)."""
        if any(r < 0 or start + r >= self.length for r in rows):
            raise InvalidInputError(f"rows {rows} after {start} are not all in the cache (length {self.length})")
        if any(b <= a for a, b in zip(rows, rows[1:])):
            raise InvalidInputError(f"rows {rows} are not increasing")
        for i, r in enumerate(rows):  # only the rows not in place move (a path's first rows often are);
            if r != i:  # rows[j] > rows[i] >= i for j > i: a row is moved before its place is overwritten
                self.keys[:, :, start + i] = self.keys[:, :, start + r]
                self.values[:, :, start + i] = self.values[:, :, start + r]
        self.length = start + len(rows)

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Valid keys and values of layer i, [kv_heads, length, head_dim] each (views)."""
        return self.keys[i, :, : self.length], self.values[i, :, : self.length]


def _norm(norm: nn.Module) -> RMSNorm:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm as a plain callable (same maths)."""
    return RMSNorm(norm.weight, norm.variance_epsilon)


class _Layer:
    """One decoder layer's weights: q/k/v and gate/up fused, every product prepacked."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Matmul.fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.splits = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.o = Matmul.of(attn.o_proj)
        self.gate_up = Matmul.fused([mlp.gate_proj, mlp.up_proj])
        self.intermediate = mlp.gate_proj.out_features
        self.down = Matmul.of(mlp.down_proj)
        self.input_norm, self.post_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = _norm(q_norm) if q_norm is not None else None
        self.k_norm = _norm(k_norm) if k_norm is not None else None
        self.scaling = float(attn.scaling)


@dataclass
class ForwardCall:
    """One sequence's target step, as :meth:`FastTargetForward.__call__` takes it (for
    :meth:`FastTargetForward.batch`)."""

    input_ids: Tensor  # [1, n]
    start: int  # position of the first row; the cache holds exactly the positions before it
    cache: StaticKVCache
    logits_rows: int  # logits of the last this many rows
    tree: tuple[Tensor, Tensor] | None = None  # (position offsets [n], visibility [n, n]): the rows are a token tree


@dataclass
class StepInputs:
    """Tensors that drive :meth:`FastTargetForward.static_step` (static buffers when replayed from a CUDA graph)."""

    input_ids: Tensor  # [1, n] long
    start: Tensor  # [1] long: position of the first row
    offsets: Tensor  # [n] long: each row's position - start (0..n-1 for a chain, depths for a tree)
    rows: Tensor  # [n] long: 0..n-1 (row i is written at cache row start + i)
    visible: Tensor  # [n, n] bool: row i sees row j of the block
    key_positions: Tensor  # [capacity] long: 0..capacity-1
    cos: Tensor  # [capacity, head_dim]: rotary tables (FastTargetForward.rotary_tables)
    sin: Tensor  # [capacity, head_dim], signed


class FastTargetForward:
    """The target's decoding forward with fused, prepacked weights over a :class:`StaticKVCache` (batch 1)."""

    def __init__(self, model: PreTrainedModel) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise InvalidInputError(f"the fast target forward does not cover this model: {reason}")
        cfg = model.config
        decoder = model.get_decoder()
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(decoder.layers[0].self_attn.head_dim)
        self.embed = model.get_input_embeddings()
        self.rotary = decoder.rotary_emb
        # a rotary of fixed inverse frequencies (not "dynamic" / "longrope", which rescale with the sequence's length):
        # a step's cos / sin rows are slices of tables kept between steps (_rope_rows)
        rope_type = str(getattr(self.rotary, "rope_type", "default"))
        self.static_rope = "dynamic" not in rope_type and "longrope" not in rope_type
        self._rope: tuple[Tensor, Tensor] | None = None  # cos, signed sin [P, head_dim] of positions 0..P-1
        self.final_norm = _norm(decoder.norm)
        head = model.get_output_embeddings()
        if isinstance(head, WEIGHT_ONLY):
            self.head: nn.Module = head  # weight-only quantized head: the drafter drafts through it too
        else:
            self.head = PackedLinear(head.weight, head.bias)  # a module: the drafter borrows it as the LM head
            if packing_supported(head.weight.device, head.weight.dtype):
                self.head.packed_weight()
        self.dtype, self.device = self.embed.weight.dtype, self.embed.weight.device
        # steps of up to row_kernels.max_rows() rows attend with the row-by-row kernel where it runs: with its
        # products (kernels.Matmul), a verify pass's row i is then bitwise the one-token step at that position
        self.row_exact = row_kernels.attention_usable(self.dtype, self.device, self.head_dim) and all(
            getattr(layer.qkv, "small", None) is not None for layer in self.layers
        )
        self.row_limit = row_kernels.max_rows(self.device)  # steps of more rows: oneDNN / SDPA
        self.batch_row_limit = row_kernels.max_batch_rows(
            self.device
        )  # batched steps of more rows: one call after another
        self.fused_weights = self._fused_weights() if self.row_exact else None

    def _fused_weights(self) -> list[Tensor] | None:
        """The tensors of ``row_kernels.decoder_layers`` (8 per layer), or None where a layer is not of the shape
        it covers (biases beyond q/k/v, norms with different epsilons)."""
        eps = {
            norm.eps
            for layer in self.layers
            for norm in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
            if norm is not None
        }
        if len(eps) != 1 or any(
            m.bias is not None for layer in self.layers for m in (layer.o, layer.gate_up, layer.down)
        ):
            return None
        self.eps = eps.pop()
        weights = []
        for layer in self.layers:
            weights += row_kernels.layer_weights(
                layer.input_norm.weight,
                layer.qkv.small,
                layer.qkv.bias32,
                layer.o.small,
                layer.post_norm.weight,
                layer.gate_up.small,
                layer.down.small,
                layer.q_norm.weight if layer.q_norm is not None else None,
                layer.k_norm.weight if layer.k_norm is not None else None,
            )
        return weights

    def new_cache(self, capacity: int = 256) -> StaticKVCache:
        return StaticKVCache(len(self.layers), self.kv_heads, self.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: Tensor,
        start: int,
        cache: StaticKVCache,
        logits_rows: int,
        feature_layers: list[int],
        tree: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run input_ids [1, n] at positions start..start+n-1 (the cache must hold exactly positions < start).

        Returns logits of the last `logits_rows` rows [logits_rows, vocab] and the feature layers' outputs
        concatenated [1, n, n_feat*hidden] (None without feature layers).

        ``tree`` = (position offsets [n], visibility bool [n, n]): the rows are a token tree instead of a
        sequence (:mod:`dflashkit.decoding.tree`): row i runs at position start + offsets[i] and sees the cache and the
        rows that visibility[i] marks (its ancestors and itself) instead of the rows before it.
        """
        n, end = input_ids.shape[1], start + input_ids.shape[1]
        positions, hidden = self._rows(n, start, cache, tree)
        x = self.embed(input_ids)  # [1, n, hidden]
        group = self.heads // self.kv_heads
        cos, sin = self._rotary(x, positions, end)  # [n, head_dim] each
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, n, head_dim]: broadcast over heads
        if self.fused_weights is not None and n <= self.row_limit:  # every layer in one C++ call
            x, features = row_kernels.decoder_layers(
                x[0],
                self.fused_weights,
                cos[0, 0],
                sin[0, 0],
                cache.keys,
                cache.values,
                start,
                hidden,
                self.heads,
                self.kv_heads,
                self.layers[0].intermediate,
                self.eps,
                self.layers[0].scaling,
                feature_layers,
            )
            cache.length = end
            return self.head(self.final_norm(x[n - logits_rows :])), features
        if self.row_exact and n <= self.row_limit:

            def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
                return row_kernels.attention(q[0], keys[0], values[0], hidden, scale)[None]
        else:
            mask = None
            if hidden is not None:  # additive (SDPA's fastest form here); packed query rows repeat per group
                mask = x.new_zeros(n, end).masked_fill_(hidden, float("-inf"))
                mask = mask[None].expand(group, n, end).reshape(1, 1, group * n, end)
            attend = functools.partial(masked_sdpa, mask=mask)

        def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:  # k, v: [1, kv_heads, n, d]
            cache.keys[i, :, start:end], cache.values[i, :, start:end] = k[0], v[0]
            return cache.keys[i : i + 1, :, :end], cache.values[i : i + 1, :, :end]

        x, features = self.run_layers(x, cos, sin, attend, write, feature_layers)
        cache.length = end
        logits = self.head(self.final_norm(x[0, n - logits_rows :]))  # [logits_rows, vocab]
        return logits, features

    def _rotary(self, x: Tensor, positions: Tensor | slice, end: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin [n, head_dim] of rows at ``positions`` (all below ``end``; a slice for a chain), in x's
        dtype: rows of the kept tables where the rotary is static (a chain's are one slice, no op), else the model's
        rotary module on them."""
        if self.static_rope:
            cos, sin = self._rope_rows(end)
            return cos[positions], sin[positions]
        if isinstance(positions, slice):
            positions = torch.arange(positions.start, positions.stop, device=x.device)
        cos, sin = self.rotary(x.reshape(1, -1, x.shape[-1]), positions[None])  # [1, n, head_dim] each
        return cos[0], signed_sin(sin[0])

    def _rope_rows(self, positions: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin tables [P, head_dim] covering positions 0..positions-1, computed by the model's rotary
        (:meth:`rotary_tables`: a row equals what a forward at that position computes), grown by doubling and kept:
        each small op of a step costs 10-70 µs once the previous pass has swept the caches, and the rotary's are ~10."""
        if self._rope is None or self._rope[0].shape[0] < positions:
            cos, sin = self.rotary_tables(max(256, 1 << (positions - 1).bit_length()))
            self._rope = (cos.contiguous(), sin.contiguous())
        return self._rope

    def _rows(
        self, n: int, start: int, cache: StaticKVCache, tree: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor | slice, Tensor | None]:
        """Checks a step of n rows at ``start`` against its cache, makes room for it, and returns the rows'
        positions (a chain's as the slice start:start+n, a tree's [n]) and what they do not see, bool [n, start+n]
        (None for one row: it sees everything)."""
        if cache.length != start:
            raise InvalidInputError(f"the KV cache holds {cache.length} positions, but the tokens start at {start}")
        end = start + n
        cache.reserve(end)
        device = cache.keys.device
        if tree is None:
            positions = slice(start, end)
        else:
            offsets, visible = tree
            if offsets.shape != (n,) or visible.shape != (n, n):
                raise InvalidInputError(f"a tree of {n} rows needs offsets [{n}] and visibility [{n}, {n}]")
            positions = offsets.to(device) + start
        hidden = None  # query i (position start+i) sees keys 0..start+i; a tree's rows see the cache and their path
        if n > 1:
            if tree is None:
                hidden = torch.ones(n, end, dtype=torch.bool, device=device).triu(start + 1)
            else:
                hidden = torch.zeros(n, end, dtype=torch.bool, device=device)
                hidden[:, start:] = ~visible.to(device)
        return positions, hidden

    def batches(self, counts: list[int]) -> bool:
        """Whether :meth:`batch` runs steps of these row counts (one per sequence) as one pass (the row kernels'
        one-call path)."""
        return self.fused_weights is not None and max(counts) <= self.row_limit and sum(counts) <= self.batch_row_limit

    @torch.inference_mode()
    def batch(self, calls: list[ForwardCall], feature_layers: list[int]) -> list[tuple[Tensor, Tensor | None]]:
        """Several sequences' steps in one pass: what :meth:`__call__` returns for each call, in order.

        Where :meth:`batches` allows the rows, every layer's products run once over all the calls' rows (the
        weights stream from memory once, not once per sequence) and each sequence attends over its own cache;
        each row is computed on its own, so every result is bitwise the one its call alone would give. Elsewhere
        the calls run one after another.
        """
        counts = [call.input_ids.shape[1] for call in calls]
        if len(calls) == 1 or not self.batches(counts):
            return [self(c.input_ids, c.start, c.cache, c.logits_rows, feature_layers, c.tree) for c in calls]
        prepared = [self._rows(n, c.start, c.cache, c.tree) for n, c in zip(counts, calls)]
        x = self.embed(torch.cat([call.input_ids[0] for call in calls]))  # [N, hidden]
        positions = torch.cat(
            [p if isinstance(p, Tensor) else torch.arange(p.start, p.stop, device=x.device) for p, _ in prepared]
        )  # [N]
        cos, sin = self._rotary(x, positions, max(c.start + n for n, c in zip(counts, calls)))  # [N, head_dim] each
        x, features = row_kernels.decoder_layers_batch(
            x,
            self.fused_weights,
            cos,
            sin,
            [(c.cache.keys, c.cache.values) for c in calls],
            [c.start for c in calls],
            counts,
            [h for _, h in prepared],
            self.heads,
            self.kv_heads,
            self.layers[0].intermediate,
            self.eps,
            self.layers[0].scaling,
            feature_layers,
        )
        first = [sum(counts[:i]) for i in range(len(calls))]  # each sequence's first row in x
        wanted = torch.cat([torch.arange(f + n - c.logits_rows, f + n) for f, n, c in zip(first, counts, calls)])
        logits = self.head(self.final_norm(x[wanted.to(x.device)]))  # [sum of logits_rows, vocab]
        out, taken = [], 0
        for f, n, call in zip(first, counts, calls):
            call.cache.length = call.start + n
            rows = logits[taken : taken + call.logits_rows]
            taken += call.logits_rows
            out.append((rows, features[f : f + n][None] if features is not None else None))
        return out

    def run_layers(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attend: Attend,
        write: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]],
        feature_layers: list[int],
    ) -> tuple[Tensor, Tensor | None]:
        """x [b, n, hidden] through every decoder layer, with rotary tables cos and signed sin broadcastable to
        [b, 1, n, head_dim]. ``write(i, k, v)`` stores layer i's new keys and values [b, kv_heads, n, d] and
        returns the keys and values to attend over [b, kv_heads, m, d]; ``attend(q, keys, values, scale)`` is the
        attention of the packed queries [b, kv_heads, group*n, d] (with the step's mask). Returns x and the
        feature layers' outputs."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        group, b, n = heads // kv_heads, x.shape[0], x.shape[1]
        wanted = {i: None for i in feature_layers}
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            qkv = layer.qkv(h)  # [b, n, (heads + 2*kv_heads) * d]
            v = qkv[..., heads * d + kv_heads * d :]
            if layer.q_norm is None:  # rotate queries and keys in one go (fewer small ops: they dominate here)
                qk = qkv[..., : (heads + kv_heads) * d].view(b, n, heads + kv_heads, d).transpose(1, 2)
                qk = rotate(qk, cos, sin)  # [b, heads + kv_heads, n, d]
                q, k = qk[:, :heads], qk[:, heads:]
            else:  # Qwen3: per-head RMSNorm of queries and keys before the rotation
                q, k, _ = qkv.split(layer.splits, dim=-1)
                q = rotate(layer.q_norm(q.view(b, n, heads, d)).transpose(1, 2), cos, sin)  # [b, heads, n, d]
                k = rotate(layer.k_norm(k.view(b, n, kv_heads, d)).transpose(1, 2), cos, sin)  # [b, kv_heads, n, d]
            keys, values = write(i, k, v.view(b, n, kv_heads, d).transpose(1, 2))
            packed = q.reshape(b, kv_heads, group * n, d)  # query heads sharing a K/V head, one block each
            out = attend(packed, keys, values, layer.scaling)  # [b, kv_heads, group*n, d]
            out = out.reshape(b, heads, n, d).transpose(1, 2).reshape(b, n, heads * d)
            x = x + layer.o(out)
            gate_up = layer.gate_up(layer.post_norm(x))
            x = x + layer.down(F.silu(gate_up[..., : layer.intermediate]) * gate_up[..., layer.intermediate :])
            if i in wanted:
                wanted[i] = x
        features = torch.cat([wanted[i] for i in feature_layers], dim=-1) if feature_layers else None
        return x, features

    @torch.inference_mode()
    def sequences(self, input_ids: Tensor, feature_layers: list[int]) -> tuple[Tensor, Tensor | None]:
        """Whole sequences [b, n] from position 0, no cache (training's target pass): the final-normed hidden
        states [b, n, hidden] and the feature layers' outputs [b, n, n_feat*hidden]. Right padding is harmless:
        attention is causal, so padding never reaches the real positions. About a third of the kernels of transformers'
        forward (SmolLM2-135M: ~800 against ~2,500), whose dispatch bounds a training step on a GPU."""
        b, n = input_ids.shape
        group = self.heads // self.kv_heads
        cos, sin = self.rotary_tables(n)  # [n, head_dim]
        future = torch.ones(n, n, dtype=torch.bool, device=self.device).triu(1)  # key j > query i: not seen
        x = self.embed(input_ids)  # [b, n, hidden]
        mask = x.new_zeros(n, n).masked_fill_(future, float("-inf"))
        mask = mask[None].expand(group, n, n).reshape(1, 1, group * n, n)  # packed query rows repeat per group
        x, features = self.run_layers(
            x,
            cos[None, None],
            sin[None, None],
            functools.partial(masked_sdpa, mask=mask),
            lambda i, k, v: (k, v),
            feature_layers,
        )
        return self.final_norm(x), features

    def rotary_tables(self, positions: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin of positions 0..positions-1 [positions, head_dim], computed by the model's own rotary
        module (each position's values do not depend on the others, so a row equals what a forward at that
        position computes)."""
        x = self.embed.weight[:1][None]  # [1, 1, hidden]: the dtype and device the tables take
        cos, sin = self.rotary(x, torch.arange(positions, device=self.device)[None])  # [1, positions, head_dim]
        return cos[0], signed_sin(sin[0])

    @torch.inference_mode()
    def static_step(
        self, step: StepInputs, keys: Tensor, values: Tensor, logits_rows: int, feature_layers: list[int]
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`__call__` driven by tensors alone, so that one capture replays at any position (CUDA graphs).

        The rows ``step.input_ids`` [1, n] are written to rows start..start+n-1 of the cache buffers ``keys`` and
        ``values`` [layers, kv_heads, capacity, head_dim] (``step.start`` [1] is a tensor) and attend over their
        whole capacity with a mask built from tensors: row i sees the
        positions before start and the rows that ``step.visible`` [n, n] marks (the rows up to i for a chain;
        its ancestors for a tree); row i's rotary position is start + ``step.offsets[i]``. No Python value
        depends on the position or the tokens, and nothing is allocated outside the step's own ops.
        """
        heads, kv_heads = self.heads, self.kv_heads
        group, n, capacity = heads // kv_heads, step.input_ids.shape[1], keys.shape[2]
        x = self.embed(step.input_ids)  # [1, n, hidden]
        positions = step.start + step.offsets  # [n]
        cos, sin = step.cos[positions][None, None], step.sin[positions][None, None]  # [1, 1, n, head_dim]
        rows = step.start + step.rows  # [n]: the cache rows written
        relative = (step.key_positions - step.start)[None]  # [1, capacity]: key position - start
        seen = step.visible[:, relative[0].clamp(0, n - 1)]  # [n, capacity]: visibility inside the block
        hidden = (relative >= n) | ((relative >= 0) & ~seen)  # [n, capacity]
        mask = torch.zeros(n, capacity, dtype=x.dtype, device=x.device).masked_fill_(hidden, float("-inf"))
        mask = mask[None].expand(group, n, capacity).reshape(1, 1, group * n, capacity)

        def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            keys[i].index_copy_(1, rows, k[0])
            values[i].index_copy_(1, rows, v[0])
            return keys[i : i + 1], values[i : i + 1]

        x, features = self.run_layers(x, cos, sin, functools.partial(masked_sdpa, mask=mask), write, feature_layers)
        logits = self.head(self.final_norm(x[0, n - logits_rows :]))  # [logits_rows, vocab]
        return logits, features
