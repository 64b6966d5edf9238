"""Training DFlash drafters: random anchors, the block attention mask, the position-decayed loss, a loop.

One training example is a target-regenerated sequence (prompt + response). The target runs once over it
(frozen) to give the feature-layer hidden states; N anchors are drawn among response tokens whose next
token is also a response token; each anchor opens a block [anchor, MASK x (B-1)] at positions anchor+k.
All blocks of a sequence are trained in one drafter pass under a mask where a block sees the context
strictly before its anchor and its own block (bidirectionally), nothing else. The loss is cross-entropy
at block offsets 1..B-1 against the sequence's tokens, weighted by exp(-(k-1)/γ) and normalised.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.checkpoint import load_drafter, save_drafter, write_drafter_files
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.identity import check_compatible, drafter_config_for, target_identity
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import CheckpointError, DFlashError, InvalidInputError
from dflashkit.fsutil import atomic_dir, atomic_write
from dflashkit.target.adapter import TargetAdapter
from dflashkit.training.dataset import (
    GPU_PAD_MULTIPLE,
    TrainingSequence,
    batches,
    collate,
    data_folders,
    draft_vocabulary,
    load_sequences,
    padded_length,
)
from dflashkit.training.distributed import SINGLE, Parallel
from dflashkit.training.features import FeatureStore
from dflashkit.training.losses import (
    BlockStates,
    acceptance_weights,
    block_cross_entropy,
    block_targets,
    row_argmax,
    sample_anchors,
    soft_block_loss,
    soft_block_targets,
    weighted_block_loss,
)
from dflashkit.training.warm_start import adds_layers_only, deepened, init_from_target, widened

# ---- the method's pieces (pure functions, tested element-wise) ----------------------------------------------


# chunk costs ~40 aten calls (forward, backward, argmax; 11,247 against 10,967 per step for 8 chunks against 1): 256-row
# chunks of 64 sequences x 32 blocks x 15 positions were ~4,700 more per step


# ---- data --------------------------------------------------------------------------------------------------


# ---- the training loop -------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    data_dir: str
    out_dir: str
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    num_layers: int | None = 3  # None: the --init drafter's depth (3 without one)
    block_size: int = 16
    gamma: float = 7.0
    # per-offset loss weights: "decay" (exp(-(k-1)/gamma), the paper's), "dpace" (acceptance_weights, dpace_alpha)
    loss_weighting: str = "decay"
    dpace_alpha: float = 0.5
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None  # None: learned mask vector
    init_from_target: bool = True
    # start from this drafter's weights (same shape, or fewer layers: deepened); its draft vocabulary is kept
    init_drafter: str | None = None
    anchors_per_seq: int = 32
    seqs_per_step: int = 8
    grad_accum: int = 1
    steps: int = 2000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    max_seq_len: int = 768
    draft_vocab_size: int | None = 8192  # None: full vocabulary in the loss
    cache_features: bool = True  # run the target once per sequence; features kept in OUT/features (disk)
    distill_topk: int = 0  # > 0: also learn the target's own distribution (its top K per position; OUT/soft-labels)
    distill_weight: float = 0.5  # loss = (1 - w) * hard cross-entropy + w * soft cross-entropy
    eval_every: int = 250
    eval_prompts: int = 6
    eval_sets: list[str] | None = None  # also τ on these evaluation sets' prompts at each evaluation ("mt-bench", ...)
    eval_set_prompts: int = 4  # prompts per evaluation set (a seeded subset)
    checkpoint_every: int = 100
    seed: int = 0
    device: str = "cpu"
    precision: str = "bf16"  # the drafter's forward: "bf16" autocast over fp32 master weights, or "fp32" throughout
    compile: bool = False  # the drafter's training forward through torch.compile (inductor); eager where it fails
    # > 0: train for about this many seconds (from the first step): the step rate measured over early steps (once
    # the feature caches are full) sizes the schedule (warmup and cosine decay) to end in time; `steps` is then the
    # most it may run, and the schedule's length until the measurement (keep it near what may fit: its warmup is
    # the run's first steps')
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        """Refuse settings that would train nothing useful (a NaN loss, a negative rate) before anything runs."""

        def bad(name: str, why: str) -> InvalidInputError:
            return InvalidInputError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in (
            "num_layers",
            "anchors_per_seq",
            "seqs_per_step",
            "grad_accum",
            "steps",
            "max_seq_len",
            "eval_every",
            "eval_prompts",
            "checkpoint_every",
            "eval_set_prompts",
        ):
            value = getattr(self, name)
            if name == "num_layers" and value is None:  # the --init drafter's depth (3 without one)
                continue
            least = 0 if name in ("eval_every", "eval_prompts", "checkpoint_every") else 1  # 0: never
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise bad(name, f"must be an integer >= {least}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise bad("block_size", "must be an integer >= 2 (the anchor and at least one draft)")
        for name in ("gamma", "lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise bad(name, "must be a finite number > 0")
        if self.loss_weighting not in ("decay", "dpace"):
            raise bad("loss_weighting", "must be 'decay' or 'dpace'")
        if not (0 <= self.dpace_alpha <= 1):
            raise bad("dpace_alpha", "must be in [0, 1]")
        if not (0 <= self.warmup_ratio < 1):
            raise bad("warmup_ratio", "must be a fraction of the steps in [0, 1)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0) or not (
            math.isfinite(self.clip) and self.clip > 0
        ):
            raise InvalidInputError(f"weight_decay must be >= 0 and clip > 0, got {self.weight_decay}, {self.clip}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise bad("draft_vocab_size", "must be a positive number of tokens (None: the whole vocabulary)")
        if self.distill_topk < 0 or not (0 <= self.distill_weight <= 1):
            raise InvalidInputError(
                f"distill_topk must be >= 0 and distill_weight in [0, 1], got "
                f"{self.distill_topk}, {self.distill_weight}"
            )
        if self.target_layer_ids is not None and (
            not self.target_layer_ids or any(not isinstance(i, int) or i < 0 for i in self.target_layer_ids)
        ):
            raise bad("target_layer_ids", "must be a non-empty list of layer indices >= 0")
        if self.eval_sets is not None:
            from dflashkit.training.evalsets import INSTALL

            unknown = [name for name in self.eval_sets if name not in INSTALL]
            if unknown or not self.eval_sets:
                raise bad("eval_sets", f"must name evaluation sets among {', '.join(INSTALL)}")
        if self.precision not in ("bf16", "fp32"):
            raise bad("precision", 'must be "bf16" or "fp32"')
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise bad("time_budget_s", "must be a number of seconds > 0 (None: no budget)")
        if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise InvalidInputError(f"the output {self.out_dir} is a file, not a folder: choose another --out")


def lr_at(step: int, cfg: TrainConfig, total: int | None = None) -> float:
    """Linear warmup, then cosine decay to 0 over ``total`` steps (default: ``cfg.steps``)."""
    total = cfg.steps if total is None else total
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """Holds target, drafter, optimizer and data; `run()` trains with checkpoints and resumes.

    Data parallel (``parallel``, from :func:`dflashkit.training.distributed.from_environment` under torchrun): every
    process holds the whole target and drafter and draws the same batches and anchors; each runs its share of
    a step's sequences, and the gradients are averaged, so a step equals the one-process step on the same
    ``seqs_per_step`` sequences. The first process writes the log, checkpoints and the drafter.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model,
        tokenizer,
        sequences: list[TrainingSequence] | None = None,
        log=print,
        parallel: Parallel = SINGLE,
    ) -> None:
        self.cfg, self.model, self.tokenizer, self.parallel = cfg, model, tokenizer, parallel
        self.log = log if parallel.is_main else (lambda *_: None)
        self.out = Path(cfg.out_dir)
        self.ckpt = self.out / "checkpoint"
        seqs = sequences if sequences is not None else load_sequences(cfg.data_dir, cfg.max_seq_len)
        vocab_size = model.get_input_embeddings().weight.shape[0]
        largest = max(max(s.input_ids) for s in seqs)
        if largest >= vocab_size:
            raise InvalidInputError(
                f"{cfg.data_dir}: token id {largest} is outside the target's vocabulary of "
                f"{vocab_size}: data regenerated by another target?"
            )
        if sequences is None and parallel.is_main:
            self._record_data_used(seqs)
        n_eval = min(cfg.eval_prompts, max(0, len(seqs) // 10))
        self.eval_seqs = seqs[:n_eval]
        held_out = {tuple(s.input_ids[: s.num_prompt]) for s in self.eval_seqs}  # no other answer of them trains
        self.train_seqs = [s for s in seqs[n_eval:] if tuple(s.input_ids[: s.num_prompt]) not in held_out]
        torch.manual_seed(cfg.seed)
        start = self._initial_drafter(model) if cfg.init_drafter else None
        if cfg.num_layers is None:  # continuing: its depth unless told otherwise
            cfg.num_layers = start.config.num_hidden_layers if start is not None else 3
        layer_ids = cfg.target_layer_ids
        if layer_ids is None and start is not None:  # continuing: its feature layers unless told otherwise
            layer_ids = list(start.config.target_layer_ids)
        shape = drafter_config_for(
            model,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            target_layer_ids=layer_ids,
            mask_token_id=cfg.mask_token_id,
        )
        start = self._fitted(start, shape) if start is not None else None
        if start is not None:  # continuing: keep its draft vocabulary
            self.vocab = start.draft_vocab
        else:
            self.vocab = draft_vocabulary(self.train_seqs, cfg.draft_vocab_size) if cfg.draft_vocab_size else None
        self.vocab = self.vocab.to(cfg.device) if self.vocab is not None else None
        # its context window: the longest context it trains on (at inference it reads no more than that by default)
        dcfg = shape.replace(
            draft_vocab=self.vocab.tolist() if self.vocab is not None else None, context_window=cfg.max_seq_len
        )
        self.drafter = DFlashDrafter(dcfg).to(cfg.device)  # fp32 master weights; bf16 autocast by default
        if start is not None:
            self.drafter.load_state_dict(start.state_dict())
        elif cfg.init_from_target:
            init_from_target(self.drafter, model)
        self.target = TargetAdapter(model, dcfg.target_layer_ids)
        self.block_states = BlockStates(self.drafter, self.target.embed_tokens)
        self.states: torch.nn.Module = self.block_states  # what training steps call
        if parallel.enabled:  # broadcasts the first process's weights, then averages gradients in backward
            device = torch.device(cfg.device)
            self.states = torch.nn.parallel.DistributedDataParallel(
                self.block_states, device_ids=[device.index] if device.type == "cuda" else None
            )
        # what a step's forward calls, spread over the processes or not: compiled on first use with cfg.compile
        self.forwards: dict[bool, Callable[..., Tensor]] = {True: self.states, False: self.block_states}
        self.compiled = cfg.compile
        if cfg.compile:
            self.forwards = {spread: torch.compile(module, dynamic=True) for spread, module in self.forwards.items()}
        if self.vocab is not None:  # target token id -> row of the draft vocabulary (-1: not in it)
            self.vocab_index = torch.full((self.target.vocab_size,), -1, dtype=torch.long, device=cfg.device)
            self.vocab_index[self.vocab] = torch.arange(self.vocab.numel(), device=cfg.device)
        self.opt = torch.optim.AdamW(
            [p for p in self.drafter.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.95),
        )
        if cfg.distill_topk < 0 or not 0 <= cfg.distill_weight <= 1:
            raise InvalidInputError(
                f"distillation needs top-k >= 0 and a weight in [0, 1], got {cfg.distill_topk} and {cfg.distill_weight}"
            )
        self.store: FeatureStore | None = None
        self.soft_store: FeatureStore | None = None
        if cfg.cache_features:  # data parallel: each process caches what it computes, in its own folder
            suffix = f"-rank{parallel.rank}" if parallel.enabled else ""
            self.seq_index = {id(s): i for i, s in enumerate(self.train_seqs)}
            self.store = FeatureStore(
                self.out / f"features{suffix}",
                [s.input_ids for s in self.train_seqs],
                width=len(dcfg.target_layer_ids) * self.target.hidden_size,
                dtype=self.target.dtype,
                signature={"target_layer_ids": list(dcfg.target_layer_ids), "target": target_identity(model)},
            )
            if cfg.distill_topk:  # ids (exact in fp32 below 2^24) and log-probabilities, side by side
                self.soft_store = FeatureStore(
                    self.out / f"soft-labels{suffix}",
                    [s.input_ids for s in self.train_seqs],
                    width=2 * cfg.distill_topk,
                    dtype=torch.float32,
                    signature={"top_k": cfg.distill_topk, "target": target_identity(model)},
                )
        self.eval_set_ids: dict[str, list[list[int]]] = {}  # evaluation-set prompts, chat-templated token ids
        if cfg.eval_sets and parallel.is_main:
            from dflashkit.text import encode_chat
            from dflashkit.training.evalsets import load_set

            for name in cfg.eval_sets:
                self.eval_set_ids[name] = [
                    encode_chat(tokenizer, p)[: cfg.max_seq_len]
                    for p in load_set(name, limit=cfg.eval_set_prompts, seed=cfg.seed)
                ]
        self.step = 0
        # the schedule's length: cfg.steps, or what a time budget measured fits (fixed once measured, checkpointed)
        self.total_steps, self.schedule_fixed = cfg.steps, cfg.time_budget_s is None
        self._rate_from: tuple[float, int] | None = None  # (time, step) where the step rate's measurement began
        self._warm_from: tuple[float, int, float] | None = None  # (time, step, feature seconds) after the compiling
        self._feature_seconds, self._features_computed = 0.0, 0  # this run's feature work for the caches so far
        self.stop_requested = False  # set by a SIGINT/SIGTERM during run(): checkpoint, then stop
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # batches padded to a multiple of this many positions off a CPU: a GPU's attention builds a plan per new
        # sequence length (cuDNN), and length-bucketed batches met hundreds of lengths in an epoch (348 in 535 steps
        # of the v12 drafter's data), so the first epoch kept building them (on an H100 it ran ~20% slower than the
        # next: the likely cause, not measured on its own); a CPU would pay for the padding
        self.pad_multiple = 1 if torch.device(cfg.device).type == "cpu" else GPU_PAD_MULTIPLE

    def _record_data_used(self, seqs: list[TrainingSequence]) -> None:
        """OUT/data_used.json: what each data folder contributed when this process started (for model cards)."""
        used = []
        for i, folder in enumerate(data_folders(self.cfg.data_dir)):
            mine = [s for s in seqs if s.source == i]
            used.append(
                {
                    "folder": str(folder),
                    "sequences": len(mine),
                    "response_tokens": sum(len(s.input_ids) - s.num_prompt for s in mine),
                }
            )
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / "data_used.json", lambda f: json.dump(used, f, indent=1))

    def _record_run_config(self) -> None:
        """OUT/run_config.json: the settings and the machine of this process, beside the log (for model cards;
        unlike the checkpoint it is small enough to copy back from a remote GPU machine)."""
        device = torch.device(self.cfg.device)
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        atomic_write(
            self.out / "run_config.json",
            lambda f: json.dump(
                {
                    "config": asdict(self.cfg),
                    "machine": machine,
                    "processes": self.parallel.world_size,
                    "torch": torch.__version__,
                },
                f,
                indent=1,
            ),
        )

    def _initial_drafter(self, model) -> DFlashDrafter:
        """The drafter named by cfg.init_drafter, checked against the target."""
        start = load_drafter(self.cfg.init_drafter, dtype=torch.float32, device=self.cfg.device)
        check_compatible(start.config, model)
        return start

    def _fitted(self, start: DFlashDrafter, want: DrafterConfig) -> DFlashDrafter:
        """`start` checked against this run's shape `want`, deepened where the run asks for more layers."""
        cfg = self.cfg
        got = start.config
        problems = [
            f"{name} {getattr(got, name)!r} (this run: {getattr(want, name)!r})"
            for name in ("block_size", "mask_token_id", "learned_mask_embedding")
            if getattr(got, name) != getattr(want, name)
        ]
        widen = got.target_layer_ids != want.target_layer_ids
        if widen and not adds_layers_only(got.target_layer_ids, want.target_layer_ids):
            problems.append(
                f"target_layer_ids {got.target_layer_ids!r} (this run: {want.target_layer_ids!r}; a run "
                "may add feature layers, not drop them)"
            )
        if got.num_hidden_layers > want.num_hidden_layers:  # deeper runs may grow it (below), never shrink it
            problems.insert(0, f"num_hidden_layers {got.num_hidden_layers} (this run: {want.num_hidden_layers})")
        if problems:
            raise InvalidInputError(
                f"--init {cfg.init_drafter}: not the shape of this run: "
                + "; ".join(problems)
                + ". Pass the matching --layers/--block-size/--target-layers/--mask-token-id."
            )
        if got.num_hidden_layers < want.num_hidden_layers:
            self.log(
                f"--init {cfg.init_drafter}: {got.num_hidden_layers} layers, deepened to "
                f"{want.num_hidden_layers} (new layers start as identities)"
            )
            start = deepened(start, want.num_hidden_layers)
        if widen:
            self.log(
                f"--init {cfg.init_drafter}: fed by target layers {got.target_layer_ids}, widened to "
                f"{want.target_layer_ids} (the new layers' fusion columns start at zero)"
            )
            start = widened(start, want.target_layer_ids)
        return start

    # ---- one step -------------------------------------------------------------------------------------

    def loss_on(self, batch: list[TrainingSequence], *, spread: bool = True) -> tuple[Tensor, dict[str, Any]]:
        """The loss of ``batch`` and its figures (``loss``, accuracy per block position, supervised positions).

        Data parallel with ``spread``: the returned loss is this process's part (its share of the sequences,
        over the whole batch's loss weight: the parts add up to the batch's loss) and the figures are the whole
        batch's. Without ``spread`` (or one process): this process computes the whole batch."""
        cfg = self.cfg
        ids, loss_mask, lengths = (t.to(cfg.device) for t in collate(batch, self.pad_id, self.pad_multiple))  # [S, L]
        B = cfg.block_size
        anchors, keep = sample_anchors(loss_mask, cfg.anchors_per_seq, self.gen)  # the same on every process
        spread = spread and self.parallel.enabled
        idle = False
        if spread:  # this process's rows; one with none runs a row at loss weight 0, to join the gradient sync
            rows = list(self.parallel.share(len(batch)))
            idle = not rows
            rows = rows or [0]
            batch = [batch[i] for i in rows]
            length = min(ids.shape[1], padded_length(int(lengths[rows].max()), self.pad_multiple))
            ids, loss_mask = ids[rows, :length], loss_mask[rows, :length]  # [S', L'] (right padding trimmed)
            lengths, anchors, keep = lengths[rows], anchors[rows], keep[rows]
        # [S, L, n_feat*H], the target's dtype; [S, L, 2K] or None
        features, soft = self.batch_features(batch, ids, loss_mask)
        labels, weights = block_targets(ids, loss_mask, lengths, anchors, keep, B, cfg.gamma)
        if idle:
            weights = torch.zeros_like(weights)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            # [S, N, B-1, H]; the mask vector is learned (the target's token rows are detached inside embed)
            hidden = self.forwards[spread](ids, anchors, keep, features)
            head = self.target.lm_head.weight.detach()
            if self.vocab is not None:  # loss over the draft vocabulary only; other labels carry no loss
                head = head[self.vocab]
                labels = self.vocab_index[labels]
                weights = weights * (labels >= 0)
                labels = labels.clamp_min(0)
            logits = hidden @ head.T  # [S, N, B-1, V']
        ce = block_cross_entropy(logits, labels)  # [S, N, B-1]
        if cfg.loss_weighting == "dpace":  # weights from the drafter's own chances of reaching each offset
            weights = acceptance_weights(torch.exp(-ce.detach()), weights > 0, cfg.dpace_alpha)
        total = self.parallel.all_sum(weights.sum()) if spread else None  # the whole batch's loss weight
        hard = weighted_block_loss(logits, labels, weights, total, ce=ce)
        terms = {}
        loss = hard
        if soft is not None:
            K = cfg.distill_topk
            columns, probs = soft_block_targets(
                soft[..., :K].long(), soft[..., K:], anchors, B, self.vocab_index if self.vocab is not None else None
            )
            soft_loss = soft_block_loss(logits, columns, probs, weights, total)
            loss = (1 - cfg.distill_weight) * hard + cfg.distill_weight * soft_loss
            terms.update(hard_loss=hard, soft_loss=soft_loss)
        with torch.no_grad():  # the batch's figures: sums over the processes' parts when spread
            supervised = (weights > 0).float()
            figures = torch.cat(
                (
                    torch.stack([loss.detach(), *(t.detach() for t in terms.values())]).float(),
                    ((row_argmax(logits) == labels).float() * supervised).sum((0, 1)),  # hits [B-1]
                    supervised.sum((0, 1)),
                )
            )  # supervised positions [B-1]
            if spread:
                figures = self.parallel.all_sum(figures)
            values, hits, counts = figures.split([1 + len(terms), B - 1, B - 1])
            values = values.tolist()
        info: dict[str, Any] = {"loss": values[0], **dict(zip(terms, values[1:]))}
        acc = (hits / counts.clamp_min(1)).tolist()
        return loss, {"acc_per_position": acc, "supervised": int(counts.sum()), **info}

    def batch_features(
        self, batch: list[TrainingSequence], ids: Tensor, loss_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Target features [S, L, n_feat*H] of a right-padded batch and, when distilling, its soft labels
        [S, L, 2K] (top-K ids as floats, then their log-probabilities); cached, each sequence runs once per run.
        With ``loss_mask`` [S, L], soft labels only where the next token carries loss (the only rows a block's
        loss reads with a weight: prompts are ~45% of a batch's rows in the shipped drafter's data); elsewhere no
        mass."""
        K = self.cfg.distill_topk
        needed = None
        if K and loss_mask is not None:  # position p predicts token p+1
            needed = torch.zeros_like(loss_mask, dtype=torch.bool)
            needed[:, :-1] = loss_mask[:, 1:].bool()

        def run_target(rows: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor | None]:
            # the adapter runs in inference mode; clones made outside it are normal tensors that autograd accepts
            if not K:
                return self.target.features(rows).clone(), None
            feats, top_ids, top_lp = self.target.features_and_top_logprobs(rows, K, positions=positions)
            return feats.clone(), torch.cat((top_ids.float(), top_lp), -1)

        if self.store is None or any(id(s) not in self.seq_index for s in batch):
            return run_target(ids, needed)
        index = [self.seq_index[id(s)] for s in batch]
        stores = [self.store] + ([self.soft_store] if K else [])
        missing = [row for row, i in enumerate(index) if not all(st.has(i) for st in stores)]
        if missing:
            began = time.perf_counter()
            feats, soft = run_target(ids[missing], needed[missing] if needed is not None else None)
            for k, row in enumerate(missing):
                n = len(batch[row].input_ids)
                self.store.put(index[row], feats[k, :n])
                if K:
                    self.soft_store.put(index[row], soft[k, :n])
            self._feature_seconds += time.perf_counter() - began
            self._features_computed += len(missing)
        outs = []
        for st in stores:
            out = torch.zeros(ids.shape[0], ids.shape[1], st.width, dtype=st.dtype)
            for row, (s, i) in enumerate(zip(batch, index)):
                out[row, : len(s.input_ids)] = st.get(i)
            outs.append(out.to(ids.device))
        return outs[0], (outs[1] if K else None)

    def train_step(self, batch_iter: Iterator[list[TrainingSequence]]) -> dict[str, Any]:
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, cfg, self.total_steps)
        self.opt.zero_grad(set_to_none=True)
        total, accs, parts = 0.0, [], {}
        world = self.parallel.world_size
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            # data parallel: gradients are averaged over the processes once, with the last micro-batch; each
            # process's loss is its part of the batch's, so world x part averages to the batch's gradient
            with self.states.no_sync() if self.parallel.enabled and not last else contextlib.nullcontext():
                batch = next(batch_iter)
                try:
                    loss, info = self.loss_on(batch)
                except Exception as exc:  # noqa: BLE001  compiling failed (e.g. no C++ compiler): train eagerly
                    if not self.compiled:
                        raise
                    self.log(
                        f"torch.compile failed ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                        "); training without it"
                    )
                    self.compiled, self.forwards = False, {True: self.states, False: self.block_states}
                    loss, info = self.loss_on(batch)  # a real error in the step raises here
                (loss * world / cfg.grad_accum).backward()
            total += info["loss"] / cfg.grad_accum
            accs.append(info["acc_per_position"])
            for name in ("hard_loss", "soft_loss"):  # when distilling: the two terms apart
                if name in info:
                    parts[name] = parts.get(name, 0.0) + info[name] / cfg.grad_accum
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.clip))
        self.opt.step()
        self.step += 1
        acc = [sum(a) / len(a) for a in zip(*accs)]
        lr = lr_at(self.step - 1, cfg, self.total_steps)
        return {"step": self.step, "loss": total, "grad_norm": grad_norm, "lr": lr, "acc": acc, **parts}

    # ---- evaluation: τ with the real decode loop on held-out prompts -------------------------------

    def heldout_metrics(self) -> dict[str, Any]:
        """Teacher-forced loss and per-position top-1 accuracy on the held-out sequences (fixed anchors).

        Less noisy than the τ estimate, and comparable to the training figures: a gap between the two
        measures overfitting.
        """
        if not self.eval_seqs:
            return {}
        state = self.gen.get_state()
        self.gen.manual_seed(self.cfg.seed + 1)
        try:
            with torch.no_grad():
                loss, info = self.loss_on(self.eval_seqs, spread=False)
        finally:
            self.gen.set_state(state)
        return {"heldout_loss": float(loss), "heldout_acc": info["acc_per_position"]}

    def estimate_tau(self, max_new_tokens: int = 48) -> float:
        """τ of the drafter as it is, greedy, with the real decode loop, on the held-out training prompts."""
        return self.tau_by_set({"": self.heldout_prompts()}, max_new_tokens)[""]

    def heldout_prompts(self) -> list[list[int]]:
        return [s.input_ids[: s.num_prompt] for s in self.eval_seqs]

    def tau_by_set(self, prompt_sets: dict[str, list[list[int]]], max_new_tokens: int = 48) -> dict[str, float]:
        """τ (greedy, the real decode loop) on each named list of prompts (token ids; NaN for an empty one), with one
        inference copy of the drafter as it is."""
        from dflashkit.decoding.loop import DecodeOptions, decode
        from dflashkit.decoding.stats import DecodeStats

        drafter = DFlashDrafter(self.drafter.config).to(device=self.model.device, dtype=self.model.dtype)
        drafter.load_state_dict(self.drafter.state_dict())
        drafter.eval()
        target = TargetAdapter(self.model, drafter.config.target_layer_ids)
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        options = DecodeOptions(max_new_tokens=max_new_tokens, stop_token_ids=frozenset(eos))
        taus = {}
        for name, prompts in prompt_sets.items():
            stats = DecodeStats(self.cfg.block_size)
            for prompt in prompts:
                for _ in decode(target, drafter, prompt, options, stats):
                    pass
            taus[name] = stats.tau if prompts else float("nan")
        return taus

    # ---- checkpoints ----------------------------------------------------------------------------------

    def save(self) -> None:
        """One atomic folder holds the drafter and the trainer state: a kill never leaves half of it.

        Data parallel: every process commits its own feature cache; the first writes the checkpoint (the
        processes hold the same weights, optimizer state and batch generator) while the others wait."""
        for store in (self.store, self.soft_store):
            if store is not None:
                store.commit()
        if not self.parallel.is_main:
            self.parallel.barrier()
            return
        state = {
            "step": self.step,
            "optimizer": self.opt.state_dict(),
            "generator": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "config": asdict(self.cfg),
            # a schedule a time budget sized keeps its length when resumed (without a budget: --steps, as given)
            "total_steps": self.total_steps if self.cfg.time_budget_s is not None and self.schedule_fixed else None,
        }
        with atomic_dir(self.ckpt) as tmp:
            write_drafter_files(self.drafter, tmp)
            torch.save(state, tmp / "trainer_state.pt")
        self.parallel.barrier()

    def resume(self) -> bool:
        """Continue from OUT/checkpoint if there is one (False: none, the run starts at step 0).

        A checkpoint that cannot be read (a truncated file, a disk that filled) or that holds a drafter of another
        shape or target than this run's raises :class:`CheckpointError`, whose message says how to start over: a
        traceback from deep in torch would not."""
        state_file = self.ckpt / "trainer_state.pt"
        if not state_file.exists():
            return False
        try:
            state = torch.load(state_file, map_location="cpu", weights_only=False)
            loaded = load_drafter(self.ckpt, dtype=torch.float32, device=self.cfg.device)
        except Exception as exc:  # noqa: BLE001  torch and safetensors raise many types for a damaged file
            reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise CheckpointError(self._start_over(f"cannot be read ({reason})")) from exc
        self._check_resumable(loaded.config)
        try:
            self.drafter.load_state_dict(loaded.state_dict())
            self.opt.load_state_dict(state["optimizer"])
            step = int(state["step"])
            total = state.get("total_steps")
            self.gen.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(self._start_over(f"is not a trainer checkpoint of this run ({exc})")) from exc
        self.step = step
        if total:  # a schedule sized by a time budget keeps its length (its lr so far)
            self.total_steps, self.schedule_fixed = int(total), True
        return True

    # the drafter's settings a checkpoint must share with this run to resume, and the options that set them
    RESUME_FIELDS = {
        "num_hidden_layers": "--layers",
        "block_size": "--block-size",
        "target_layer_ids": "--target-layers",
        "mask_token_id": "--mask-token-id",
        "learned_mask_embedding": "--mask-token-id",
        "hidden_size": "--target",
        "intermediate_size": "--target",
        "num_attention_heads": "--target",
        "num_key_value_heads": "--target",
        "head_dim": "--target",
        "vocab_size": "--target",
        "num_target_layers": "--target",
    }

    def _check_resumable(self, saved: DrafterConfig) -> None:
        """Refuse a checkpoint of another drafter shape or target than this run's, naming what differs."""
        ours = self.drafter.config
        problems = [
            f"{name} {getattr(saved, name)!r} (this run: {getattr(ours, name)!r}; {flag})"
            for name, flag in self.RESUME_FIELDS.items()
            if getattr(saved, name) != getattr(ours, name)
        ]
        if not problems:
            try:
                check_compatible(saved, self.model)
            except DFlashError as exc:
                problems.append(f"another target ({exc})")
        if problems:
            raise CheckpointError(
                self._start_over(
                    "holds a drafter that does not fit this run: "
                    + "; ".join(problems)
                    + f". To resume it, run it with the options it was made with (recorded in "
                    f"{self.out / 'run_config.json'})"
                )
            )

    def _start_over(self, what: str) -> str:
        """The message of a checkpoint that cannot be resumed: what is wrong, then how to start over."""
        return (
            f"the checkpoint in {self.ckpt} {what}. To start over, run the same command with --no-resume (the "
            f"checkpoint is replaced at its next save), or delete the run folder {self.out}"
        )

    def run(self, resume: bool = True, progress: bool = True) -> Path:
        cfg, main = self.cfg, self.parallel.is_main
        if resume and self.resume():
            self.log(f"resumed at step {self.step}")
        log_file = None
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._record_run_config()
            log_path = self.out / "train_log.jsonl"
            if log_path.exists():  # drop entries of steps past the checkpoint (a killed run redoes them)
                kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
                log_path.write_text("".join(ln + "\n" for ln in kept))
            log_file = log_path.open("a")
        batch_iter = batches(self.train_seqs, cfg.seqs_per_step, cfg.seed)
        for _ in range(self.step * cfg.grad_accum):  # a resumed run sees the batches it would have seen
            next(batch_iter)
        from tqdm import tqdm

        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not (progress and main), desc="train", dynamic_ncols=True
        )
        t0 = time.perf_counter()
        self.stop_requested = False
        try:
            with _graceful_stop(self):
                self._loop(batch_iter, bar, log_file, t0)
        finally:
            bar.close()
            if log_file is not None:
                log_file.close()
        if main:
            save_drafter(self.drafter.to(torch.bfloat16), self.out / "drafter")
        self.parallel.barrier()
        return self.out / "drafter"

    def _size_schedule(self, t0: float, first_step: int, bar) -> bool:
        """With a time budget: once the steps after the first two (compiling) and after the feature caches are full
        (a CPU run's first epoch computes the features: slower steps) have run for a while, fix the schedule's length
        to the steps that fit the rest of the budget at their rate (at most cfg.steps; data parallel: the fewest any
        process can do). At half the budget it is fixed whatever was measured: with the caches still filling, from the
        steps' rate without their feature work and the features still to compute at their cost so far (the filling
        steps' own rate would plan too few steps). True once the budget is spent."""
        budget, now = self.cfg.time_budget_s, time.perf_counter()
        if budget is None:
            return False
        if self.schedule_fixed:
            return self.parallel.any(now - t0 >= budget, self.cfg.device)
        caches_full = all(store is None or bool(store.filled.all()) for store in (self.store, self.soft_store))
        if self._warm_from is None and self.step >= first_step + 2:  # compiled by now: the fallback's rate from here
            self._warm_from = (now, self.step, self._feature_seconds)
        if self._rate_from is None and self.step >= first_step + 2 and caches_full:
            self._rate_from = (now, self.step)
        measured = (
            self._rate_from is not None
            and self.step - self._rate_from[1] >= 5
            and (now - self._rate_from[0] >= min(30.0, 0.1 * budget))
        )
        if not self.parallel.any(measured or now - t0 >= 0.5 * budget, self.cfg.device):
            return False
        left = max(0.0, budget - (now - t0))
        if self._rate_from is not None and self.step > self._rate_from[1]:
            start_time, start_step = self._rate_from
            rate = (self.step - start_step) / max(1e-9, now - start_time)  # steps per second
            how = f"{rate:.2f} steps/s over steps {start_step}-{self.step}"
        else:  # half the budget gone before a measurement (caches still filling): the steps' rate without the
            # features (after the first two steps, which compile, where steps ran since), and the time the features
            # still to compute take at their cost so far
            start_time, start_step, start_features = t0, first_step, 0.0
            if self._warm_from is not None and self.step > self._warm_from[1]:
                start_time, start_step, start_features = self._warm_from
            work = now - start_time - (self._feature_seconds - start_features)
            rate = (self.step - start_step) / max(1e-9, work)
            unfilled = int((~self.store.filled).sum()) if self.store is not None else 0
            to_fill = unfilled * self._feature_seconds / max(self._features_computed, 1)
            left = max(0.0, left - to_fill)
            how = (
                f"{rate:.2f} steps/s over steps {start_step}-{self.step} without their feature work, and "
                f"{to_fill:.0f} s of features still to compute"
            )
        fit = self.step + int(0.97 * rate * left)
        total = min([self.cfg.steps, *(int(f) for f in self.parallel.gather_objects(fit))])
        self.total_steps, self.schedule_fixed = max(total, self.step), True
        bar.total = self.total_steps
        bar.refresh()
        self.log(f"time budget {budget:g} s: {self.total_steps} steps in all ({how})")
        return False

    def _loop(self, batch_iter, bar, log_file, t0: float) -> None:
        cfg = self.cfg
        first_step, self._rate_from, self._warm_from = self.step, None, None
        self._feature_seconds, self._features_computed = 0.0, 0
        while self.step < self.total_steps:
            # Ctrl-C / SIGTERM: keep this step's work, then stop (data parallel: all at the same step)
            if self.parallel.any(self.stop_requested, cfg.device):
                self.save()
                self.log(f"stopped at step {self.step}; checkpoint saved: the same command resumes here")
                raise KeyboardInterrupt
            rec = self.train_step(batch_iter)
            spent = self._size_schedule(t0, first_step, bar)  # the time budget is spent: this run ends here
            last = spent or self.step == self.total_steps
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or last):
                if self.parallel.is_main:  # the first process evaluates while the others wait
                    # the held-out training prompts ("") and the evaluation sets' own (MT-Bench, HumanEval, ...)
                    taus = self.tau_by_set({"": self.heldout_prompts(), **self.eval_set_ids})
                    rec["tau"] = taus.pop("")
                    if taus:
                        rec["tau_sets"] = taus
                    rec.update(self.heldout_metrics())
                self.parallel.barrier()
            rec["elapsed_s"] = time.perf_counter() - t0
            if log_file is not None:
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
            bar.update(1)
            shown = {"loss": f"{rec['loss']:.3f}", "acc1": f"{rec['acc'][0]:.2f}"}
            if "heldout_acc" in rec:
                shown.update(tau=f"{rec['tau']:.2f}", heldout_acc1=f"{rec['heldout_acc'][0]:.2f}")
            bar.set_postfix(shown)
            if self.step % cfg.checkpoint_every == 0 or last:
                self.save()
            if spent and self.step < self.total_steps:
                self.log(
                    f"time budget of {cfg.time_budget_s:g} s spent at step {self.step} of {self.total_steps}; "
                    "checkpoint saved (the same command resumes here)"
                )
                break


@contextmanager
def _graceful_stop(trainer: Trainer) -> Iterator[None]:
    """While training in the main thread, the first SIGINT/SIGTERM asks the loop to checkpoint at the end of the
    current step and stop (nothing computed is lost); a second SIGINT interrupts at once. Under torchrun a
    Ctrl-C reaches each process twice (from the terminal, then forwarded by torchrun): a SIGINT within
    a second of the first is the same request."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first_at = 0.0  # when the stop was requested

    def request(signum, frame) -> None:
        nonlocal first_at
        if trainer.stop_requested and signum == signal.SIGINT:
            if not (trainer.parallel.enabled and time.monotonic() - first_at < 1.0):
                raise KeyboardInterrupt
            return
        trainer.stop_requested = True
        first_at = time.monotonic()
        trainer.log("stopping after this step (checkpointing; Ctrl-C again to stop at once)")

    previous = {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
