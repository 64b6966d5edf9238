"""The target answering token-id prompts in batches, through the engine that fits (continuous, static, batches, or a
server): answers for training data and Magpie's user turns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflashkit.decoding.sampling import SamplingParams
from dflashkit.errors import InvalidInputError
from dflashkit.target.fast import FastTargetForward, unsupported_reason
from dflashkit.text import eos_token_ids
from dflashkit.training.batchgen import generate_batch, generate_continuous, generate_static

ENGINES = ("auto", "continuous", "static", "batches")


@dataclass
class Answerer:
    """Continues token-id prompts with the target, through the engine :func:`regenerate` chose: answers for the
    training data, and the user turns of the ``magpie`` source. Build it with :meth:`for_target`."""

    engine: str  # continuous | static | batches | server
    eos_ids: list[int]
    pad_id: int
    batch_size: int
    model: Any = None
    forward: FastTargetForward | None = None
    server: Any = None

    @classmethod
    def for_target(
        cls, model: Any, tokenizer: Any, *, engine: str = "auto", batch_size: int = 32, server: Any = None
    ) -> Answerer:
        """``engine`` as for :func:`regenerate`; "auto" resolves to continuous on a CPU and static on a GPU where
        the fast forward covers the target, batches elsewhere."""
        if engine not in ENGINES:
            raise InvalidInputError(f"engine must be 'auto', 'continuous', 'static' or 'batches', got {engine!r}")
        if batch_size < 1:
            raise InvalidInputError(f"batch_size must be >= 1, got {batch_size}")
        eos_ids = server.eos_ids if server is not None else eos_token_ids(model, tokenizer)
        if not eos_ids:
            raise InvalidInputError("the tokenizer/model defines no eos token: responses could never end")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        if server is not None:
            return cls("server", eos_ids, pad_id, batch_size, server=server)
        forward = None
        if engine != "batches":
            device = next(model.parameters()).device
            reason = unsupported_reason(model)
            if engine == "continuous" and not reason and device.type != "cpu":
                reason = f"the model is on {device.type}"
            if not reason:
                forward = FastTargetForward(model)
                if engine == "auto":
                    engine = "continuous" if device.type == "cpu" else "static"
            elif engine in ("continuous", "static"):
                raise InvalidInputError(
                    f"engine {engine!r} runs on targets the fast forward covers"
                    f"{' (continuous: on a CPU)' if engine == 'continuous' else ''}: {reason}"
                )
        return cls(engine if forward is not None else "batches", eos_ids, pad_id, batch_size, model, forward)

    @property
    def device(self) -> torch.device | None:
        return None if self.model is None else next(self.model.parameters()).device

    @property
    def rng_devices(self) -> list[torch.device]:
        """The devices whose random state ``torch.random.fork_rng`` keeps around seeded answering: the GPU the
        model is on, if any (the CPU's is always kept)."""
        device = self.device
        return [device] if device is not None and device.type == "cuda" else []

    def answers(
        self,
        encoded: Sequence[tuple[int, list[int]]],
        *,
        seed: int,
        group: int,
        max_new_tokens: int,
        sampling: SamplingParams,
    ) -> Iterator[list[tuple[int, list[int], list[int]]]]:
        """(label, prompt ids, new ids) of the ``(label, prompt ids)`` in ``encoded``, in groups as they are answered.

        Sampled answers are reproducible: continuous batching and a server draw each prompt's answer from a seed of
        its own (``seed`` and its label), the static engine seeds per ``group``, transformers' batches per group and
        the batch's first label, so a resumed shard draws as a fresh one."""
        if self.engine == "continuous":  # a seed per prompt: the same answers whatever the slots
            seeds = None if sampling.greedy else [seed * 1_000_003 + i for i, _ in encoded]
            for j, response in generate_continuous(
                self.forward,
                [ids for _, ids in encoded],
                slots=self.batch_size,
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos_ids,
                sampling=sampling,
                seeds=seeds,
            ):
                yield [(encoded[j][0], encoded[j][1], response)]
            return
        if self.engine == "static":  # seeded per group (shard): a resumed shard draws as a fresh one
            torch.manual_seed((seed * 1_000_003 + group) * 1_000_033)
            for j, response in generate_static(
                self.forward,
                [ids for _, ids in encoded],
                slots=self.batch_size,
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos_ids,
                sampling=sampling,
            ):
                yield [(encoded[j][0], encoded[j][1], response)]
            return
        for b in range(0, len(encoded), self.batch_size):
            batch = encoded[b : b + self.batch_size]
            if self.server is not None:  # a seed per prompt: the same answers whichever batch it is in
                responses = self.server.answer(
                    [ids for _, ids in batch],
                    [seed * 1_000_003 + i for i, _ in batch],
                    max_new_tokens=max_new_tokens,
                    sampling=sampling,
                )
            else:
                torch.manual_seed((seed * 1_000_003 + group) * 1_000_033 + batch[0][0])  # per batch: resumable
                responses = generate_batch(
                    self.model,
                    [ids for _, ids in batch],
                    max_new_tokens=max_new_tokens,
                    eos_ids=self.eos_ids,
                    pad_id=self.pad_id,
                    sampling=sampling,
                )
            yield [(i, ids, response) for (i, ids), response in zip(batch, responses)]
