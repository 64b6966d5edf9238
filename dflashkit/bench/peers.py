"""The alternatives a user would pick, as benchmark methods: transformers' own ``generate`` (plain, prompt
lookup, assisted by a small draft model) and llama.cpp through ``llama-cpp-python``.

Each is a :class:`~dflashkit.bench.methods.Method`; another peer (e.g. a ``llama-server`` driven over HTTP)
is one more subclass with ``unavailable()`` and ``generate()``. A peer that cannot run here (no draft
model with the target's tokenizer, llama-cpp-python not installed, no GGUF) says why in ``unavailable()``
and the runner skips it with that line.

transformers' peers run the target with transformers' own attention ("sdpa"; dflashkit's loop uses its
packed grouped-query form), so their greedy tokens may part from the baseline's at bf16 ties.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from .methods import KERNELS, OTHER_WEIGHTS, Method, Record, Request, TargetSession

LLAMA_CPP_INSTALL = "pip install 'dflashkit[llamacpp]' (llama-cpp-python; it compiles llama.cpp, ~8 minutes on 2 cores)"


class _ChunkTimer(BaseStreamer):
    """A transformers streamer that notes when each chunk of new tokens arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.chunks: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()
        self.chunks.append(int(value.numel()))

    def end(self) -> None:
        pass


class TransformersGenerate(Method):
    """transformers' ``model.generate`` on the same bf16 model: plain, prompt lookup or assisted generation."""

    family = "transformers"
    comparable = KERNELS

    def __init__(
        self,
        session: TargetSession,
        variant: str = "plain",
        *,
        prompt_lookup_tokens: int = 10,
        assistant: PreTrainedModel | None = None,
        assistant_tokenizer: PreTrainedTokenizerBase | None = None,
        assistant_label: str = "",
        missing_assistant: str = "no draft model with the target's tokenizer",
    ) -> None:
        if variant not in ("plain", "prompt-lookup", "assisted"):
            raise ValueError(f"unknown transformers variant {variant!r}")
        self.session, self.variant = session, variant
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.assistant, self.assistant_tokenizer = assistant, assistant_tokenizer
        self.missing_assistant = missing_assistant
        self.name = {"plain": "hf-generate", "prompt-lookup": "hf-prompt-lookup", "assisted": "hf-assisted"}[variant]
        attention = session.original_attention or "its default"
        self.note = {
            "plain": f"transformers generate(), {attention} attention, dynamic cache",
            "prompt-lookup": f"transformers generate(prompt_lookup_num_tokens={prompt_lookup_tokens}), {attention} attention",
            "assisted": f"transformers generate(assistant_model={assistant_label or '?'}), {attention} attention",
        }[variant]

    def unavailable(self) -> str | None:
        if self.variant != "assisted":
            return None
        if self.assistant is None:
            return self.missing_assistant
        if self.assistant_tokenizer is not None and (
            self.assistant_tokenizer.get_vocab() != self.session.tokenizer.get_vocab()
        ):
            return "the draft model's tokenizer differs from the target's"
        return None

    def generation_config(self, request: Request) -> GenerationConfig:
        """The exact settings: greedy, or pure temperature sampling (top-k / top-p off, unlike transformers' defaults)."""
        pad = self.session.tokenizer.pad_token_id
        kw: dict[str, Any] = {
            "max_new_tokens": request.max_new_tokens,
            "eos_token_id": sorted(request.stop_token_ids),
            "pad_token_id": pad if pad is not None else min(request.stop_token_ids, default=0),
        }
        if request.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=request.temperature, top_k=0, top_p=1.0)
        if self.variant == "prompt-lookup":
            kw.update(prompt_lookup_num_tokens=self.prompt_lookup_tokens)
        return GenerationConfig(**kw)

    def generate(self, request: Request) -> Record:
        ids = torch.tensor([request.prompt_ids], device=self.session.model.device)
        config = self.generation_config(request)
        extra = {"assistant_model": self.assistant} if self.variant == "assisted" else {}
        torch.manual_seed(request.seed)
        with self.session.transformers_mode() as model, torch.inference_mode():
            timer = _ChunkTimer()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=timer, **extra)
            total = time.perf_counter() - timer.t0
        tokens = out[0, ids.shape[1] :].tolist()
        speculative = self.variant != "plain"
        return Record(
            tokens=tokens,
            ttft_s=(timer.first - timer.t0) if timer.first is not None else total,
            total_s=total,
            # every chunk after the prompt is one verification step: accepted candidates + the target's token
            accepted_lengths=[c - 1 for c in timer.chunks] if speculative else None,
            block_size=self.max_candidates() + 1 if speculative else 1,
        )

    def max_candidates(self) -> int:
        """Most candidate tokens per step: prompt_lookup_num_tokens, or the assistant's num_assistant_tokens
        (transformers' default 20, constant schedule, confidence threshold 0.4)."""
        if self.variant == "prompt-lookup":
            return self.prompt_lookup_tokens
        config = getattr(self.assistant, "generation_config", None)
        return int(getattr(config, "num_assistant_tokens", None) or 20)


class LlamaCpp(Method):
    """llama.cpp autoregressive decoding of a GGUF through ``llama-cpp-python`` (greedy or temperature sampling)."""

    name = "llama.cpp"
    family = "llama.cpp"
    comparable = OTHER_WEIGHTS

    def __init__(
        self,
        gguf: str | os.PathLike | None,
        *,
        threads: int,
        n_ctx: int = 4096,
        vocab_size: int | None = None,
        missing_gguf: str = "no GGUF of the target (pass --gguf PATH)",
    ) -> None:
        self.gguf = pathlib.Path(gguf) if gguf is not None else None
        self.threads, self.n_ctx, self.vocab_size = threads, n_ctx, vocab_size
        self.missing_gguf = missing_gguf
        self.llm: Any = None
        name = self.gguf.name if self.gguf else "?"
        self.note = f"llama-cpp-python on {name}, {threads} thread(s), autoregressive; its own kernels and weights"

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return f"llama-cpp-python is not installed: {LLAMA_CPP_INSTALL}"
        if self.gguf is None:
            return self.missing_gguf
        if not self.gguf.is_file():
            return f"GGUF file {self.gguf} does not exist"
        return None

    def _load(self) -> Any:
        if self.llm is None:
            import llama_cpp

            self.llm = llama_cpp.Llama(
                model_path=str(self.gguf), n_threads=self.threads, n_threads_batch=self.threads, n_ctx=self.n_ctx,
                seed=0, verbose=False,
            )  # fmt: skip
            n_vocab = self.llm.n_vocab()
            if self.vocab_size is not None and n_vocab != self.vocab_size:
                raise ValueError(f"{self.gguf.name} has a vocabulary of {n_vocab}, the target {self.vocab_size}")
        return self.llm

    def generate(self, request: Request) -> Record:
        llm = self._load()
        llm.reset()  # no reuse of the previous prompt's evaluated prefix
        if hasattr(llm, "set_seed"):
            llm.set_seed(request.seed)
        sampling = {"temp": 0.0} if request.greedy else {"temp": request.temperature, "top_k": 0}
        stop = set(request.stop_token_ids) | {llm.token_eos()}
        tokens: list[int] = []
        t0 = time.perf_counter()
        first = None
        gen = llm.generate(request.prompt_ids, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True, **sampling)
        try:
            for token in gen:
                if first is None:
                    first = time.perf_counter()
                tokens.append(int(token))
                if token in stop or len(tokens) >= request.max_new_tokens:
                    break
        finally:
            gen.close()
        total = time.perf_counter() - t0
        return Record(tokens=tokens, ttft_s=(first - t0) if first is not None else total, total_s=total)

    def close(self) -> None:
        if self.llm is not None and hasattr(self.llm, "close"):
            self.llm.close()
        self.llm = None
