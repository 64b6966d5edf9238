"""The alternatives a user would pick, as benchmark methods: transformers' own ``generate`` (plain, prompt
lookup, assisted by a small draft model), llama.cpp through ``llama-cpp-python``, and llama.cpp's
``llama-server`` (plain, or its own DFlash with a drafter exported by dflashkit).

Each is a :class:`~dflashkit.bench.methods.Method` with ``unavailable()`` and ``generate()``. A peer that cannot run
here (no draft
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

from dflashkit.bench.methods import KERNELS, OTHER_WEIGHTS, Method, Record, Request, TargetSession

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
            "prompt-lookup": f"transformers generate(prompt_lookup_num_tokens={prompt_lookup_tokens}), "
            f"{attention} attention",
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
        """The exact settings: greedy, or pure temperature sampling (top-k / top-p off, unlike transformers'
        defaults)."""
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
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=timer, **extra
            )
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
                model_path=str(self.gguf),
                n_threads=self.threads,
                n_threads_batch=self.threads,
                n_ctx=self.n_ctx,
                seed=0,
                verbose=False,
            )
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
        gen = llm.generate(
            request.prompt_ids, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True, **sampling
        )
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


class LlamaServerPeer(Method):
    """llama.cpp's `llama-server` on a GGUF: plain decoding, llama.cpp's DFlash with a drafter exported by
    dflashkit (`drafter_gguf`), or its classic speculative decoding with a smaller model of the target's family
    (`draft_model_gguf`, llama.cpp's default number of drafts). Started on loopback at the first request, stopped by
    `close()`; every figure comes from the server's own `timings` (prompt and generation time, drafted and accepted
    tokens)."""

    family = "llama.cpp"

    def __init__(
        self,
        name: str,
        binary: str | os.PathLike | None,
        model_gguf: str | os.PathLike | None,
        *,
        threads: int,
        comparable: str,
        drafter_gguf: str | os.PathLike | None = None,
        draft_model_gguf: str | os.PathLike | None = None,
        block_size: int = 16,
        missing: str = "",
        log_dir: str | os.PathLike | None = None,
    ) -> None:
        if drafter_gguf and draft_model_gguf:
            raise ValueError("a DFlash drafter or a draft model, not both")
        self.name, self.comparable, self.threads, self.block_size = name, comparable, threads, block_size
        self.binary = pathlib.Path(binary) if binary else None
        self.model_gguf = pathlib.Path(model_gguf) if model_gguf else None
        self.drafter_gguf = pathlib.Path(drafter_gguf) if drafter_gguf else None
        self.draft_model_gguf = pathlib.Path(draft_model_gguf) if draft_model_gguf else None
        self.missing, self.log_dir = missing, log_dir
        self.server: Any = None
        model = self.model_gguf.name if self.model_gguf else "?"
        if drafter_gguf:
            how = f"DFlash with {self.drafter_gguf.name}, block size {block_size}"
        elif draft_model_gguf:
            how = f"speculative decoding with the draft model {self.draft_model_gguf.name} (llama.cpp's default drafts)"
        else:
            how = "autoregressive"
        self.note = f"llama-server on {model}, {how}, {threads} thread(s); timed by its own `timings`"

    def unavailable(self) -> str | None:
        if self.missing:
            return self.missing
        if self.binary is None or self.model_gguf is None:
            return "no llama-server binary or GGUF given"
        for what, path in (
            ("llama-server", self.binary),
            ("GGUF", self.model_gguf),
            ("drafter GGUF", self.drafter_gguf),
            ("draft model GGUF", self.draft_model_gguf),
        ):
            if path is not None and not path.is_file():
                return f"{what} {path} does not exist"
        return None

    def _server(self) -> Any:
        if self.server is None:
            from dflashkit.interop.llama_server import LlamaServer

            log = pathlib.Path(self.log_dir) / f"{self.name}.log" if self.log_dir else None
            draft_model = self.draft_model_gguf is not None
            self.server = LlamaServer(
                self.binary,
                self.model_gguf,
                drafter=self.draft_model_gguf if draft_model else self.drafter_gguf,
                block_size=None if draft_model else self.block_size,
                spec_type="draft-simple" if draft_model else "draft-dflash",
                threads=self.threads,
                log_path=log,
            ).start()
        return self.server

    def generate(self, request: Request) -> Record:
        c = self._server().complete(
            request.prompt_ids, request.max_new_tokens, temperature=request.temperature, seed=request.seed
        )
        ttft = c.prompt_ms / 1000.0
        speculative = self.drafter_gguf is not None or self.draft_model_gguf is not None
        return Record(
            tokens=c.tokens,
            ttft_s=ttft,
            total_s=ttft + c.predicted_ms / 1000.0,
            steps_total=c.target_passes if speculative else None,
            accepted_total=c.draft_n_accepted if speculative else None,
            # a draft model's drafts per step are llama.cpp's choice (None: not one fixed size)
            block_size=None if self.draft_model_gguf is not None else self.block_size if speculative else 1,
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.server = None
