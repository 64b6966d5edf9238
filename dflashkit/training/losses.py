"""Training losses: random anchors, the block attention mask, teacher-forced block scores, the position-decayed and
soft (distilled) losses."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.drafter.layers import BlockMask
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError


def sample_anchors(
    loss_mask: Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Random anchors per sequence among positions i with loss_mask[i] and loss_mask[i+1].

    loss_mask [S, L] bool. Returns sorted anchors [S, N] (long) and keep [S, N] (bool; False marks padding
    blocks of sequences with fewer than N valid anchors, whose anchor is set to 0).
    """
    S, L = loss_mask.shape
    valid = torch.zeros_like(loss_mask)
    valid[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    scores = torch.rand(S, L, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~valid, 2.0)  # invalid positions sort last
    order = scores.argsort(dim=1)[:, :num_anchors]  # [S, N] random distinct positions, valid first
    n = min(num_anchors, L)
    keep = torch.arange(n, device=loss_mask.device)[None] < valid.sum(1, keepdim=True)
    anchors = torch.where(keep, order, torch.zeros_like(order))
    anchors, perm = torch.sort(torch.where(keep, anchors, torch.full_like(anchors, L)), dim=1)
    keep = torch.gather(keep, 1, perm)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def context_mask(anchors: Tensor, keep: Tensor, seq_len: int, block_size: int) -> Tensor:
    """Context keys each block query sees: bool [S, N*B, seq_len], True where j < anchor of its block
    (strictly: the anchor's own feature is not yet known at inference); padding blocks see none."""
    anchor_of_query = anchors.repeat_interleave(block_size, 1)  # [S, N*B]
    visible = torch.arange(seq_len, device=anchors.device)[None, None, :] < anchor_of_query[:, :, None]
    return visible & keep.repeat_interleave(block_size, 1)[:, :, None]


def training_attention_mask(anchors: Tensor, keep: Tensor, seq_len: int, block_size: int) -> Tensor:
    """The dense form of the training mask: bool [S, 1, N*B, seq_len + N*B].

    Keys are [context 0..seq_len-1 | block 0 | ... | block N-1]; a query of block b sees context j < anchor_b
    and all B positions of block b; padding blocks (keep False) see nothing. Training computes the same
    thing block-sparsely (drafter.BlockMask); this form is the reference the tests compare against.
    """
    S, N = anchors.shape
    q_block = torch.arange(N * block_size, device=anchors.device) // block_size
    own = (q_block[:, None] == q_block[None, :])[None] & keep.repeat_interleave(block_size, 1)[:, :, None]
    return torch.cat((context_mask(anchors, keep, seq_len, block_size), own), dim=2)[:, None]


def block_hidden(
    drafter: DFlashDrafter,
    ids: Tensor,
    anchors: Tensor,
    keep: Tensor,
    embed_tokens: torch.nn.Module,
    *,
    features: Tensor | None = None,
    context: list | None = None,
) -> Tensor:
    """Teacher-forced drafter hidden states [S, N, B-1, H] of the blocks anchored at anchors [S, N] in ids [S, L]:
    each block is its anchor token then mask tokens, and sees the target's features of the positions strictly
    before its anchor (the mask of §4.3): ``features`` [S, L, n_feat*H], or their injected K/V ``context`` when
    already computed. What training scores, and what the offline estimates (scripts/) look at."""
    S, L = ids.shape
    B, N = drafter.block_size, anchors.shape[1]
    block_ids = torch.full((S, N, B), drafter.config.mask_token_id, device=ids.device)
    block_ids[:, :, 0] = torch.gather(ids, 1, anchors)
    positions = (anchors[:, :, None] + torch.arange(B, device=ids.device)).flatten(1)  # [S, N*B]
    mask = BlockMask(context_mask(anchors, keep, L, B), B)  # padding blocks see only themselves: no NaN
    emb = drafter.embed(block_ids.flatten(1), embed_tokens)  # [S, N*B, H]; the target's rows detached inside
    if context is None:
        if features is None:
            raise InvalidInputError("block_hidden needs the target's features or their injected context")
        context = drafter.context_key_values(features, torch.arange(L, device=ids.device))
    return drafter(emb, positions, context, mask).view(S, N, B, -1)[:, :, 1:]


@torch.inference_mode()
def teacher_forced_scores(
    drafter: DFlashDrafter, target, ids: list[int], start: int, chunk: int = 64
) -> Iterator[tuple[Tensor, Tensor]]:
    """The drafter's scores at every anchor a in [start, len(ids)-2] of one sequence, teacher-forced as training
    sees it (the target's features of the text before a): (anchors [N], fp32 scores [N, B-1, V']) per chunk of
    anchors, over the draft vocabulary (``drafter.draft_vocab``; the whole vocabulary without one). ``target``: a
    :class:`~dflashkit.target.adapter.TargetAdapter`. What the offline estimates of scripts/ read."""
    L = len(ids)
    seq = torch.tensor([ids])
    context = drafter.context_key_values(target.features(seq), torch.arange(L))  # [1, L, F] -> per-layer K/V
    head, _ = drafter._draft_head(target.lm_head)
    for first in range(start, L - 1, chunk):
        anchors = torch.arange(first, min(first + chunk, L - 1))[None]  # [1, N]
        hidden = block_hidden(
            drafter, seq, anchors, torch.ones_like(anchors, dtype=torch.bool), target.embed_tokens, context=context
        )[0]  # [N, B-1, H]
        yield anchors[0], head(hidden).float()  # [N], [N, B-1, V']


class BlockStates(torch.nn.Module):
    """:func:`block_hidden` as one module call: what DistributedDataParallel wraps (it syncs the gradients of
    what its forward runs). Only the drafter is a submodule; the target's frozen embedding table is held
    outside the module tree, so that data parallelism neither broadcasts nor syncs it."""

    def __init__(self, drafter: DFlashDrafter, embed_tokens: torch.nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self._frozen = (embed_tokens,)

    def forward(self, ids: Tensor, anchors: Tensor, keep: Tensor, features: Tensor) -> Tensor:
        return block_hidden(self.drafter, ids, anchors, keep, self._frozen[0], features=features)


LOSS_CHUNK_ROWS = 256  # rows of [rows, V] logits per chunk of the loss on a CPU (256 x 8,192 fp32: 8 MB)


DEVICE_LOSS_CHUNK_ROWS = 16384  # elsewhere (512 MB): a GPU step is bound by dispatching its operations, and each


def loss_chunk_rows(logits: Tensor) -> int:
    """Rows per chunk of the loss and the accuracy's argmax over logits [rows, V] on their device."""
    return LOSS_CHUNK_ROWS if logits.device.type == "cpu" else DEVICE_LOSS_CHUNK_ROWS


def position_weights(block_size: int, gamma: float) -> Tensor:
    """w_k = exp(-(k-1)/γ) for block offsets k = 1..B-1 (offset 0, the anchor, carries no loss)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_targets(
    input_ids: Tensor, loss_mask: Tensor, lengths: Tensor, anchors: Tensor, keep: Tensor, block_size: int, gamma: float
) -> tuple[Tensor, Tensor]:
    """Labels [S, N, B-1] (the token at anchor+k) and loss weights [S, N, B-1] for offsets k = 1..B-1.

    weight = keep · (anchor+k < length) · loss_mask[anchor+k] · exp(-(k-1)/γ); no cumulative product.
    """
    S, L = input_ids.shape
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[:, :, None] + k  # [S, N, B-1]
    inside = pos < lengths[:, None, None]
    pos_c = pos.clamp(max=L - 1)
    labels = torch.gather(input_ids, 1, pos_c.flatten(1)).view_as(pos)
    supervised = torch.gather(loss_mask, 1, pos_c.flatten(1)).view_as(pos)
    weights = (keep[:, :, None] & inside & supervised).float() * position_weights(block_size, gamma).to(pos.device)
    return labels, weights


def acceptance_weights(label_prob: Tensor, valid: Tensor, alpha: float = 0.5) -> Tensor:
    """D-PACE's loss weights [..., B-1] (arXiv 2605.18810; ModelOpt's default DFlash objective): the drafter's own
    (detached) probability q_k of each label gives s_k = (1-α)·q_k + α, a smoothed chance that offset k is accepted;
    prefix_k = Π_{j<=k} s_j is the chance that the block is accepted through k, and w_k = Σ_{j>=k} prefix_j the
    accepted length that depends on offset k (every later offset needs it). So the loss spends itself where the
    drafter already reaches, instead of a fixed decay. An offset without a label (past the sequence end, a token
    outside the draft vocabulary, not supervised) can never be accepted: s = 0 there, which ends the prefix."""
    s = torch.where(valid, (1 - alpha) * label_prob.detach().float() + alpha, 0.0)  # [..., B-1]
    prefix = torch.cumprod(s, -1)
    return prefix.flip(-1).cumsum(-1).flip(-1) * valid


def block_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of every block position [...] (fp32), logits [..., V] and labels [...]: what the losses weight,
    and exp(-CE) the drafter's own probability of each label (D-PACE's weights)."""
    # in chunks of rows: each chunk's fp32 copy, log-softmax and their gradients stay in the CPU's caches instead
    # of making several passes through memory over [rows, V] (the same values: every row's CE is its own)
    rows, chunk = logits.flatten(0, -2), loss_chunk_rows(logits)
    return torch.cat(
        [
            F.cross_entropy(part.float(), part_labels, reduction="none")
            for part, part_labels in zip(rows.split(chunk), labels.flatten().split(chunk))
        ]
    ).view_as(labels)


def weighted_block_loss(
    logits: Tensor, labels: Tensor, weights: Tensor, total_weight: Tensor | None = None, *, ce: Tensor | None = None
) -> Tensor:
    """Σ CE·w / Σ w over all block positions; logits [..., V], labels/weights [...] (``ce``: their
    :func:`block_cross_entropy`, where already computed).

    ``total_weight``: the denominator when these positions are one process's part of a batch spread over
    several (Σ w over the whole batch), so that the parts add up to the whole batch's loss."""
    ce = block_cross_entropy(logits, labels) if ce is None else ce
    total = weights.sum() if total_weight is None else total_weight
    return (ce * weights).sum() / total.clamp_min(1e-9)


def row_argmax(logits: Tensor) -> Tensor:
    """argmax over the last dimension of logits [..., V] (any float dtype), in row chunks converted to fp32 (exact;
    the same index, ties to the first): torch's CPU argmax over bf16 is several times slower than over fp32."""
    rows = logits.detach().flatten(0, -2)
    return torch.cat([part.float().argmax(-1) for part in rows.split(loss_chunk_rows(rows))]).view(logits.shape[:-1])


def soft_block_targets(
    top_ids: Tensor, top_logprobs: Tensor, anchors: Tensor, block_size: int, column_of: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The target's own distribution over the token at anchor+k (k = 1..B-1), as soft labels.

    top_ids / top_logprobs [S, L, K]: the target's K likeliest next tokens after each position and their
    log-probabilities (TargetAdapter.features_and_top_logprobs); the token at anchor+k is predicted at
    position anchor+k-1. ``column_of`` [vocab] maps token ids to loss columns (a draft vocabulary; -1: not in
    it, dropped). Returns columns [S, N, B-1, K] (long; 0 where dropped) and probabilities [S, N, B-1, K]
    renormalised over the kept entries (all 0 where none is kept). Positions past the sequence end get
    whatever the padding row holds: their loss weight is 0 (block_targets).
    """
    S, L, K = top_ids.shape
    k = torch.arange(1, block_size, device=anchors.device)
    rows = (anchors[:, :, None] + k - 1).clamp(max=L - 1).flatten(1)  # [S, N*(B-1)]
    index = rows[:, :, None].expand(-1, -1, K)
    ids = torch.gather(top_ids, 1, index).view(S, anchors.shape[1], block_size - 1, K)
    probs = torch.gather(top_logprobs, 1, index).view_as(ids).float().exp()
    if column_of is not None:
        ids = column_of[ids]
        probs = probs * (ids >= 0)
        ids = ids.clamp_min(0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    return ids, probs


def soft_block_loss(
    logits: Tensor, columns: Tensor, probs: Tensor, weights: Tensor, total_weight: Tensor | None = None
) -> Tensor:
    """Σ w · (−Σ_j p_j log softmax(logits)[c_j]) / Σ w: cross-entropy against the target's own distribution
    (its top K, renormalised), i.e. forward KL up to a constant; logits [..., V], columns/probs [..., K].
    ``total_weight`` as in :func:`weighted_block_loss`."""
    logq = logits.float().log_softmax(-1).gather(-1, columns)  # [..., K]
    ce = -(probs * logq).sum(-1)
    total = weights.sum() if total_weight is None else total_weight
    return (ce * weights).sum() / total.clamp_min(1e-9)
