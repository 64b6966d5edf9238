"""The public generation API: prompt text in, streamed text and statistics out.

    gen = SpeculativeGenerator.load(drafter="path/to/drafter")   # embedded SmolLM2 target by default
    for delta in gen.stream("Write a haiku about the sea."):
        print(delta.text, end="")
    result = gen.generate("Hi!", compare_ar=True)

It owns the chat template, stop strings and detokenisation; the token-level loop is `decode.decode`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflashkit.decoding.adaptive import LOOKUP_ALONE_BLOCK, AdaptiveBlockSize, BlockPolicies
from dflashkit.decoding.batching import BatchMember, ComputeThread, ForwardBatcher, member_thread
from dflashkit.decoding.defaults import (
    default_block_size,
    default_lookup,
    default_sampler,
    default_tree,
    default_tree_copies,
)
from dflashkit.decoding.grammar import CompiledGrammar, Grammar, grammar_tokenizer
from dflashkit.decoding.loop import DecodeOptions, StepObserver, as_token_list, decode
from dflashkit.decoding.lossless import Divergence, DivergenceRecorder
from dflashkit.decoding.penalties import Penalties
from dflashkit.decoding.prefix_cache import PrefixCache, ScopedPrefixCache
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.tree import check_tree_option
from dflashkit.drafter.identity import check_compatible
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from dflashkit.target.logprobs import TokenLogprob, check_top_logprobs
from dflashkit.text import IncrementalDetokenizer, StopStringMatcher, check_text, encode_chat, eos_token_ids
from dflashkit.tool_calls import ToolRequest, check_template, marker_terms, template_messages

Prompt = str | Sequence[dict[str, str]]  # plain text, or chat messages [{"role": ..., "content": ...}]


@dataclass
class TextDelta:
    """A piece of streamed output: its text and the tokens behind it (from_draft: accepted draft tokens; origins:
    each token's "drafter", "copy" or "target", as :data:`dflashkit.decoding.loop.ORIGINS` explains).

    token_text[i] is the text released when token i arrived ("" while held back: a split character, a
    possible stop string); the pieces concatenate to `text`, and text released at the end of generation
    goes to the last token. logprobs[i]: token i's log-probability under the target (when requested).
    """

    text: str
    token_ids: list[int]
    from_draft: list[bool]
    token_text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on a stream's first delta only, when requested
    origins: list[str] | None = None  # one per token id ("drafter", "copy", "target"); None: not known


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    from_draft: list[bool]
    stats: DecodeStats
    finish_reason: str | None
    prompt_tokens: int
    ar: GenerationResult | None = None  # the plain-decoding run, with compare_ar
    divergence: Divergence | None = None  # with compare_ar and greedy: first differing token, judged
    logprobs: list[TokenLogprob] | None = None  # one per token id, when requested (stream(logprobs=...))
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..n-1, when requested
    stop_string: str | None = None  # the stop string that ended the text (finish_reason "stop"), if one did
    origins: list[str] | None = None  # one per token id: "drafter", "copy" (prompt lookup) or "target"

    @property
    def identical(self) -> bool | None:
        return None if self.ar is None else self.token_ids == self.ar.token_ids

    @property
    def speedup(self) -> float | None:
        """Plain decode time per token / speculative decode time per token (prefill excluded)."""
        if self.ar is None or not self.stats.decode_tokens_per_s or not self.ar.stats.decode_tokens_per_s:
            return None
        return self.stats.decode_tokens_per_s / self.ar.stats.decode_tokens_per_s


@dataclass
class GenerationStream:
    """Iterate for TextDelta pieces; `result` is set once the iteration ends."""

    _deltas: Iterator[TextDelta]
    result: GenerationResult | None = field(default=None)

    def __iter__(self) -> Iterator[TextDelta]:
        return self._deltas

    def close(self) -> None:
        """Stop the generation early (its caches end consistent; no result is set)."""
        close = getattr(self._deltas, "close", None)
        if close is not None:
            close()


class SpeculativeGenerator:
    """A target model (+ its tokenizer) and, optionally, a DFlash drafter for it; without one, optionally prompt
    lookup alone by default (``lookup_without_drafter``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafter: DFlashDrafter | None = None,
        *,
        fast: bool = True,
        cuda_graphs: bool = True,
        lookup_without_drafter: bool = False,
    ) -> None:
        """``fast`` (default): the fast path: the target decodes through dflashkit's fast forward where its
        architecture is covered (fused prepacked GEMMs, static KV cache; see :class:`TargetAdapter`) and the
        drafter's linear layers run on prepacked oneDNN weights; False: the eager path (transformers' forward,
        plain ``nn.Linear``), for debugging and comparisons. ``cuda_graphs`` (default): on a CUDA device the target's
        and the drafter's decode steps are replayed from CUDA graphs (:mod:`dflashkit.kernels.cuda_graphs`).
        ``lookup_without_drafter``: without a drafter, generations run prompt lookup alone unless they ask otherwise
        (see :meth:`uses_lookup`)."""
        if drafter is not None:
            check_compatible(drafter.config, model)
            param = next(drafter.parameters())
            if param.dtype != model.dtype or param.device != model.device:
                drafter = drafter.to(device=model.device, dtype=model.dtype)
            drafter.use_fast_path(fast)
            drafter.graphs = None
            if fast and cuda_graphs and next(drafter.parameters()).device.type == "cuda":
                drafter.use_step_graphs()  # drafting steps replayed from CUDA graphs, as the target's
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.target = TargetAdapter(
            model, drafter.config.target_layer_ids if drafter else (), fast=fast, cuda_graphs=cuda_graphs
        )
        if not fast:
            self.target.use_packed_linears(False)  # an earlier fast adapter may have packed them
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.block_policies: BlockPolicies | None = (
            BlockPolicies(drafter.block_size) if drafter is not None and drafter.block_size >= 2 else None
        )  # used by block_size="auto"; greedy and sampled requests each carry their estimates over to the next
        # Prompt lookup alone (no drafter, or use_drafter=False with lookup=True), block_size="auto": copies sized per
        # step, or declined for a plain step where they do not pay (BlockPolicies' lookup_alone)
        self.lookup_policies = BlockPolicies(LOOKUP_ALONE_BLOCK, lookup_alone=True)
        # Whether a generation without a drafter runs prompt lookup alone when it does not say (lookup=None): set by
        # load(drafter="auto") when no drafter ships for the target, so that such a target still decodes
        # speculatively; False (plain decoding unless lookup=True) for an explicit drafter=None. Read by
        # uses_lookup(), which the generations and the server's /health follow.
        self.lookup_without_drafter = lookup_without_drafter and drafter is None
        self._grammar_tokenizer: Any = None  # llguidance's view of the tokenizer, built on the first grammar
        self._token_bytes: Callable[[int], bytes] | None = None

    @property
    def block_policy(self) -> AdaptiveBlockSize | None:
        """The adaptive block-size policy of greedy requests (None without a drafter; prompt lookup alone sizes its
        copies with ``lookup_policies.get(True).copies``)."""
        return self.block_policies.get(True) if self.block_policies is not None else None

    def uses_lookup(self, lookup: bool | None = None, use_drafter: bool = True) -> bool:
        """Whether a generation asking for ``lookup`` (None: the default) runs prompt lookup: as asked; by default
        with the drafter, and without one where ``lookup_without_drafter`` says so, never for a plain run
        (``use_drafter=False``, as ``compare_ar`` and benchmark baselines decode) (:func:`default_lookup`)."""
        has_drafter = self.drafter is not None and use_drafter
        return default_lookup(lookup, has_drafter, self.lookup_without_drafter and use_drafter)

    @classmethod
    def load(
        cls,
        target: str | None = None,
        drafter: str | None = "auto",
        *,
        dtype: torch.dtype | str = torch.bfloat16,
        device: str = "cpu",
        quantize: str | None = None,
        fast: bool = True,
        cuda_graphs: bool = True,
    ) -> SpeculativeGenerator:
        """Load a target (None: the embedded SmolLM2-135M-Instruct) and a drafter: a folder, "auto" (the drafter
        shipped with dflashkit for that target, if there is one) or None (no drafter: plain decoding unless a
        generation asks for ``lookup=True``). When "auto" finds no drafter for the target, generations run prompt
        lookup alone by default (``lookup_without_drafter``): where the text repeats itself a step verifies a copy
        of what followed, sized per step by the adaptive policy, which takes plain steps where copies do not pay;
        ``lookup=False`` decodes plainly. Either way the output is the target's own.

        ``quantize="int8"``: weight-only int8 target weights (:mod:`dflashkit.kernels.int8`); the output is then
        exact with respect to that quantized target, not the ``dtype`` one. ``fast=False``: the eager path;
        ``cuda_graphs=False``: no CUDA graphs on a GPU (see ``__init__``).
        """
        from dflashkit.drafter.checkpoint import load_drafter
        from dflashkit.target.loading import load_target

        if isinstance(dtype, str):
            named = getattr(torch, dtype, None)
            if not isinstance(named, torch.dtype):
                raise InvalidInputError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
            dtype = named
        if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
            raise InvalidInputError(f"drafter must be a folder, 'auto' or None, got {type(drafter).__name__}")
        model, tokenizer = load_target(target, dtype=dtype, device=device, quantize=quantize)
        from dflashkit.drafter.registry import drafter_folder

        folder = drafter_folder(drafter, target)
        draft = load_drafter(folder, dtype=dtype, device=device) if folder else None
        return cls(
            model, tokenizer, draft, fast=fast, cuda_graphs=cuda_graphs, lookup_without_drafter=drafter == "auto"
        )

    # ---- prompts ---------------------------------------------------------------------------------------

    def encode_prompt(
        self, prompt: Prompt, chat: bool = True, tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a prompt; text goes through the chat template (as one user turn) when there is one.

        ``tools``: OpenAI function tools the template shows the model (a template that writes calls as
        ``<tool_call>`` is required; :mod:`dflashkit.tool_calls` parses them out of the answer)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("the prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)):
            malformed = InvalidInputError("chat messages must be a non-empty list of {'role': ..., 'content': text}")
            if not prompt or any(not isinstance(m, dict) or "role" not in m for m in prompt):
                raise malformed
            messages = template_messages(prompt)  # OpenAI's forms of tool calls as templates take them
            if any(not isinstance(m.get("content"), str) for m in messages):
                raise malformed
        else:
            raise InvalidInputError(f"the prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
        for m in messages:
            check_text(m["content"])
        if tools:
            if not chat:
                raise InvalidInputError("tools go through the chat template: they cannot be given with chat=False")
            check_template(self.tokenizer)
        return encode_chat(
            self.tokenizer, prompt if isinstance(prompt, str) else messages, chat, tools=list(tools) if tools else None
        )

    # ---- generation ------------------------------------------------------------------------------------

    def stream(
        self,
        prompt: Prompt | list[int],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        block_size: int | str | None = None,
        proposal: str = "sample",
        proposal_temperature: float | None = None,
        sampler: str | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        use_drafter: bool = True,
        chat: bool = True,
        observer: StepObserver | None = None,
        lookup: bool | None = None,
        ngram_store: bool = True,
        tree: int | None = None,
        tree_copies: bool | None = None,
        draft_window: int | None = None,
        grammar: Grammar | CompiledGrammar | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        batch: BatchMember | None = None,
        prefix_cache: PrefixCache | ScopedPrefixCache | None = None,
    ) -> GenerationStream:
        """Start a generation; iterate the returned stream for text deltas, then read `.result`.

        `prompt` may be text, chat messages, or token ids (used as is). Without a drafter (or with
        use_drafter=False) and without prompt lookup the same loop decodes autoregressively. ``block_size="auto"``
        picks each step's block size (up to the drafter's) for the most tokens per second (see
        :mod:`dflashkit.decoding.adaptive`); an integer fixes it; None (the default) is "auto", or the drafter's own
        size with ``tree`` (see :func:`default_block_size`). ``lookup=True`` (None, the default: on when a drafter
        drafts, and without one for a generator loaded with ``drafter="auto"``, see :meth:`uses_lookup`): where the
        text so far ends with an n-gram seen before, a step drafts the tokens that followed it instead of running the
        drafter (:mod:`dflashkit.decoding.lookup`; with no drafter: prompt lookup alone, with ``block_size`` None or
        "auto" its copies sized per step, and declined for plain steps where they do not pay). With
        lookup, where the text has no repeat of its own, the drafter's n-gram store of the target's
        past answers drafts, if the drafter folder has one (:mod:`dflashkit.drafter.ngram_store`; ``ngram_store=False``
        turns it off). ``tree=N``: drafter steps verify a token tree of up to N nodes (the drafter's likeliest
        alternatives; with the rejection sampler, candidates drawn from the drafter: :mod:`dflashkit.decoding.tree`)
        instead of
        a chain; on the fast forward only (elsewhere: chains). ``tree=None`` (the default): trees of
        :data:`COUPLED_TREE` nodes for seeded sampling with the adaptive block size, chains otherwise
        (:func:`default_tree`); ``tree=0``: chains in any case. ``tree_copies``: whether a greedy or seeded step
        that copies (lookup, the n-gram store) verifies one tree of the copy and the drafter's candidates instead of
        the copy as a chain; None (the default): yes for a tree asked for, no for the default seeded trees (on a
        2-core CPU the drafter's pass on every copied step cost more than the trees' extra tokens brought:
        docs/experiments.md).
        ``sampler`` (when sampling): "rejection" (speculative sampling, the most drafts accepted) or "coupled"
        (Gumbel-max with noise fixed by the seed and position: the output is the plain sampled output of the
        seed, whatever the drafter, block size, lookup or batch; see :mod:`dflashkit.decoding.sampling`); None (the
        default): "coupled" when a seed is given, "rejection" otherwise (:func:`default_sampler`).
        ``proposal_temperature``: when sampling, the drafter proposes at this multiple of the temperature (None:
        the drafter's own ``config.proposal_temperature``, 1.0 unless its folder says otherwise); exact at any value.
        ``draft_window=N``: drafting attends to the last N context tokens (0: all; None: the drafter's own
        ``config.context_window``). ``grammar``: structured output, every token one the grammar allows (a
        :class:`~dflashkit.decoding.grammar.Grammar`: ``Grammar.json_schema(schema)``, ``.json_object()``,
        ``.regex(...)``,
        ``.lark(...)``); exact with respect to the target constrained to it; chains only (no trees). Still lossless.
        ``logprobs=K``: every delta (and the result) carries each token's log-probability under the target and
        its K likeliest alternatives (0 to 20; :mod:`dflashkit.target.logprobs`), read off the verify passes.
        ``prompt_logprobs=K``: the same for the prompt's tokens after the first (one more pass over the prompt),
        on the first delta and the result.
        ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, over the output), ``repetition_penalty``
        (transformers', over prompt and output), ``logit_bias`` ({token id: bias}): the target decodes with its
        logits so adjusted (:mod:`dflashkit.decoding.penalties`); exact with respect to that adjusted target; chains
        only.
        ``batch``: this generation's target passes run together with those of the batcher's other members (a
        :class:`~dflashkit.decoding.batching.BatchMember`; see :meth:`generate_batch`); its tokens are unchanged.
        ``prefix_cache``: a :class:`~dflashkit.decoding.prefix_cache.PrefixCache` (one per target), or one owner's
        view of one (``cache.scoped(owner)``): the prefill restores the
        longest prefix of the prompt that an earlier generation kept there (the next turn of a chat) and runs only
        the rest; the result's ``stats.cached_prompt_tokens`` says how many; this generation is kept there too.
        """
        if isinstance(block_size, str) and block_size != "auto":
            raise InvalidInputError(f"block_size must be an integer >= 2, None or 'auto', got {block_size!r}")
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise InvalidInputError("the prompt is empty")
        ids = as_token_list(prompt) if _is_token_ids(prompt) else self.encode_prompt(prompt, chat)
        if isinstance(stop, str):
            stop = [stop]
        drafter = self.drafter if use_drafter else None
        tree = check_tree_option(tree)  # 0: chains, whatever the default
        tree_copies = default_tree_copies(tree_copies, tree)  # before tree takes its default
        lookup = self.uses_lookup(lookup, use_drafter)
        block_size = default_block_size(block_size, drafter is not None, tree, lookup)
        adaptive = block_size == "auto"
        store = drafter.ngram_store if drafter is not None and lookup and ngram_store else None
        sampling = SamplingParams(temperature, top_k, top_p)
        sampler = default_sampler(sampler, seed)
        penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty, logit_bias or {})
        tree = default_tree(
            tree,
            has_drafter=drafter is not None,
            sampled=not sampling.greedy,
            sampler=sampler,
            block_size=block_size,
            batched=batch is not None,
            supports_trees=self.target.supports_trees,
            constrained=grammar is not None or penalties.active,
        )
        options = DecodeOptions(
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            block_size=None if adaptive else block_size,
            proposal=proposal,
            proposal_temperature=proposal_temperature,
            seed=seed,
            sampler=sampler,
            stop_token_ids=frozenset(self.eos_token_ids) | frozenset(stop_token_ids),
            lookup=lookup,
            lookup_store=store,
            tree=tree,
            tree_copies=tree_copies,
            draft_window=draft_window,
            grammar=self.compile_grammar(grammar) if grammar is not None else None,
            logprobs=logprobs,
            penalties=penalties,
        )
        # batched passes (CPU row kernels): a member's blocks are capped by the batch's size at each step
        # (adaptive.BATCH_ROWS); members join and leave while it decodes
        # prompt lookup alone: the policies that size its copies (or decline them for plain steps)
        policies = self.block_policies if drafter is not None else self.lookup_policies if lookup else None
        policy = None
        if adaptive and policies is not None:
            greedy = options.sampling.greedy
            if batch is None:
                policy = policies.get(greedy, tree=tree is not None and drafter is not None)
            else:
                batcher, batches = batch.batcher, self.target.batches_passes
                policy = policies.for_batch(greedy, lambda: batcher.members if batches else 1)
        stream = GenerationStream(iter(()))
        if prefix_cache is not None and not isinstance(prefix_cache, (PrefixCache, ScopedPrefixCache)):
            raise InvalidInputError(
                f"prefix_cache must be a PrefixCache (or its scoped() view), got {type(prefix_cache).__name__}"
            )
        stream._deltas = self._run(
            ids,
            drafter,
            options,
            list(stop),
            observer,
            stream,
            policy,
            check_top_logprobs(prompt_logprobs, "prompt_logprobs"),
            batch,
            prefix_cache,
        )
        return stream

    def _run(
        self,
        ids,
        drafter,
        options,
        stop,
        observer,
        stream: GenerationStream,
        policy: AdaptiveBlockSize | None = None,
        prompt_top: int | None = None,
        batch: BatchMember | None = None,
        prefix_cache: PrefixCache | ScopedPrefixCache | None = None,
    ) -> Iterator[TextDelta]:
        prompt_logprobs = None
        if prompt_top is not None:  # one pass over the prompt (a batch member's, in the batch's compute thread)
            prompt_logprobs = _computed(batch, self.target.prompt_logprobs, ids, prompt_top)
        stats = DecodeStats(block_size=1)
        detok = IncrementalDetokenizer(self.tokenizer)
        matcher = StopStringMatcher(stop)
        tokens: list[int] = []
        flags: list[bool] = []
        origins: list[str] = []
        logprobs: list[TokenLogprob] | None = [] if options.logprobs is not None else None
        target = batch.target(self.target) if batch is not None else self.target
        drafter = batch.drafter(drafter) if batch is not None else drafter
        policy = batch.policy(policy) if batch is not None else policy
        steps = decode(target, drafter, ids, options, stats, observer, policy, prefix_cache)
        stats.adaptive = policy is not None
        try:
            for step in steps:
                start = len(tokens)
                pieces: list[str] = []
                for token, origin in zip(step.tokens, step.origins):
                    tokens.append(token)
                    flags.append(origin != "target")
                    origins.append(origin)
                    pieces.append(matcher.push(detok.push([token])))
                    if matcher.stopped:
                        break
                if (step.finished and not matcher.stopped) and pieces:
                    pieces[-1] += matcher.push(detok.flush()) + matcher.flush()
                if len(tokens) > start:
                    step_logprobs = step.logprobs[: len(tokens) - start] if logprobs is not None else None
                    if logprobs is not None:
                        logprobs.extend(step_logprobs)
                    yield TextDelta(
                        "".join(pieces),
                        tokens[start:],
                        flags[start:],
                        pieces,
                        step_logprobs,
                        prompt_logprobs if start == 0 else None,
                        origins[start:],
                    )
                if matcher.stopped:
                    stats.finish_reason = "stop"
                    break
        finally:
            steps.close()
        stats.new_tokens = len(tokens)
        stream.result = GenerationResult(
            text=matcher.text,
            token_ids=tokens,
            from_draft=flags,
            stats=stats,
            finish_reason=stats.finish_reason,
            prompt_tokens=len(ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_string=matcher.matched,
            origins=origins,
        )

    def score(
        self,
        prompt: Prompt | list[int],
        *,
        prompt_logprobs: int = 0,
        chat: bool = True,
        batch: BatchMember | None = None,
    ) -> GenerationStream:
        """The prompt's log-probabilities only, nothing generated (the completions API's echo with max_tokens 0):
        a stream of one empty delta carrying `prompt_logprobs`, its result with no tokens. ``batch``: the pass
        runs in that batch member's compute thread."""
        check_top_logprobs(prompt_logprobs, "prompt_logprobs")
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise InvalidInputError("the prompt is empty")
        ids = as_token_list(prompt) if _is_token_ids(prompt) else self.encode_prompt(prompt, chat)
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise InvalidInputError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        stream = GenerationStream(iter(()))

        def run() -> Iterator[TextDelta]:
            logprobs = _computed(batch, self.target.prompt_logprobs, ids, prompt_logprobs)
            yield TextDelta("", [], [], [], [], logprobs)
            stream.result = GenerationResult(
                text="",
                token_ids=[],
                from_draft=[],
                stats=DecodeStats(block_size=1),
                finish_reason="length",
                prompt_tokens=len(ids),
                logprobs=[],
                prompt_logprobs=logprobs,
            )

        stream._deltas = run()
        return stream

    def generate(self, prompt: Prompt | list[int], *, compare_ar: bool = False, **kwargs: Any) -> GenerationResult:
        """Generate to the end (kwargs as for `stream`). With compare_ar, also decode plainly (see compare_ar)."""
        result = _drain(self.stream(prompt, **kwargs))
        return self.compare_ar(result, prompt, **kwargs) if compare_ar else result

    def generate_batch(
        self, prompts: Sequence[Prompt | list[int]], *, seeds: Sequence[int | None] | None = None, **kwargs: Any
    ) -> list[GenerationResult]:
        """Generate for several prompts at once (kwargs as for `stream`, the same for all; ``seeds``: one per prompt):
        one thread per prompt, their target passes batched into one pass per round (:mod:`dflashkit.decoding.batching`).
        Each result is exactly what `generate` gives for its prompt alone (greedy, or sampled with its seed);
        the batch as a whole finishes sooner where the passes batch (the fast forward's CPU row kernels)."""
        prompts = list(prompts)
        if not prompts:
            raise InvalidInputError("generate_batch needs at least one prompt")
        if seeds is not None and len(seeds) != len(prompts):
            raise InvalidInputError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one per prompt")
        if "batch" in kwargs or "observer" in kwargs:
            raise InvalidInputError("generate_batch takes neither `batch` nor `observer`")
        seed = kwargs.pop("seed", None)
        if len(prompts) == 1:  # nothing to batch with (and a batch of one pays for the threads' handoffs)
            return [self.generate(prompts[0], seed=seeds[0] if seeds is not None else seed, **kwargs)]
        compute = ComputeThread()  # this thread: it runs every pass and drafter forward of the batch
        batcher = ForwardBatcher(self.target, compute)
        members = [batcher.join() for _ in prompts]  # all joined before any decodes: the first round has them all
        try:
            streams = [
                self.stream(p, seed=seeds[i] if seeds is not None else seed, batch=members[i], **kwargs)
                for i, p in enumerate(prompts)
            ]  # bad input fails here, before any thread starts
        except BaseException:
            for member in members:
                batcher.leave(member)
            raise
        results: list[GenerationResult | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            member_thread(compute)
            try:
                results[i] = _drain(streams[i])
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                errors.append(exc)
            finally:
                batcher.leave(members[i])  # under the batcher's lock: the count below is exact
                compute.wake()

        threads = [threading.Thread(target=run, args=(i,), name=f"dflashkit-batch-{i}") for i in range(len(prompts))]
        for t in threads:
            t.start()
        try:
            compute.serve(until=lambda: batcher.members == 0)
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]

    def compare_ar(self, result: GenerationResult, prompt: Prompt | list[int], **kwargs: Any) -> GenerationResult:
        """Decode `prompt` plainly with the same settings and attach that run to `result`.

        When greedy, or sampled with the coupled sampler (a seed given), the outputs must be identical, and
        `result.divergence` locates the first differing token and judges it on the plain step's logits (noisy
        scores when coupled): a tie or not (see lossless).
        """
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("use_drafter", "observer", "block_size", "lookup", "ngram_store", "tree", "prefix_cache")
        }
        greedy = SamplingParams(kwargs.get("temperature", 0.0), kwargs.get("top_k", 0), kwargs.get("top_p", 1.0)).greedy
        coupled = default_sampler(kwargs.get("sampler"), kwargs.get("seed")) == "coupled"
        recorder = DivergenceRecorder(result.token_ids, self.target.dtype) if greedy or coupled else None
        result.ar = _drain(self.stream(prompt, **kwargs, use_drafter=False, observer=recorder))
        result.divergence = recorder.result(result.ar.token_ids) if recorder else None
        return result

    def compile_grammar(self, grammar: Grammar | CompiledGrammar) -> CompiledGrammar:
        """`grammar` checked against this target's tokenizer (the tokenizer's grammar view is built once)."""
        if isinstance(grammar, CompiledGrammar):
            return grammar
        if not isinstance(grammar, Grammar):
            raise InvalidInputError(f"grammar must be a dflashkit.Grammar, got {type(grammar).__name__}")
        return CompiledGrammar(grammar, self._llg_tokenizer(), self.target.vocab_size, self.eos_token_ids)

    def tool_call_grammar(self, tools: ToolRequest) -> CompiledGrammar | None:
        """The grammar of ``tool_choice`` "required" or a named function over this tokenizer (its tool-call tags
        as the tokens it has for them), compiled; None when the choice forces nothing."""
        if not tools.forced:
            return None
        markers = marker_terms(self.tokenizer, self._llg_tokenizer())
        grammar = tools.grammar(markers)
        assert grammar is not None
        return self.compile_grammar(grammar)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a token may hold part of a UTF-8 character); special tokens: their text.
        Read from llguidance's view of the tokenizer; where it cannot read the tokenizer, the token's decoded text."""
        if self._token_bytes is None:
            try:
                view = self._llg_tokenizer()
                self._token_bytes = lambda t: view.decode_bytes([t])
            except InvalidInputError:
                self._token_bytes = lambda t: self.tokenizer.decode([t]).encode("utf-8", "surrogatepass")
        return self._token_bytes(token_id)

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (grammars, token bytes), built on first use (~1 s)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.target.vocab_size, self.eos_token_ids)
        return self._grammar_tokenizer

    def warmup(self) -> None:
        """One short generation with and without the drafter, so first-call costs stay out of timings."""
        for use_drafter in (True, False):
            _drain(self.stream("Hello", max_new_tokens=4, use_drafter=use_drafter))


def _computed(batch: BatchMember | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: in the batch's compute thread for a batch member, here otherwise."""
    return batch.compute(fn, *args) if batch is not None else fn(*args)


def _drain(stream: GenerationStream) -> GenerationResult:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple, torch.Tensor)) and len(prompt) > 0 and not isinstance(prompt[0], dict)
