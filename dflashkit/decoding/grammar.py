"""Structured output: generation constrained to a grammar (any JSON object, a JSON schema, a regex, Lark).

The grammar engine is llguidance (the one llama.cpp, vLLM and SGLang use); it says, after any token prefix,
which tokens may come next. The constrained target is the target whose logits are set to -inf outside that
set before warping (temperature, top-k, top-p), at every position: plain decoding samples it directly, and
speculative decoding stays exact with respect to it because both sides of every comparison are constrained:

* the target's verify rows are masked, each by the set allowed after the anchor and the drafts before it;
* drafter proposals are made from the drafter's scores masked row by row (the set after the drafts already
  proposed in this block), and q, the proposal distribution in the acceptance ratio, is that masked one;
* copied drafts (prompt lookup) are one-hot proposals: they are cut at the first token the grammar refuses
  (a one-hot draft the constrained target gives probability 0 would be rejected anyway, and its residual is
  the constrained target itself, so cutting it changes nothing).

Token trees are not used under a grammar (chains only).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflashkit.errors import DFlashError, InvalidInputError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark")
# Between JSON tokens: at most one line break and 32 spaces or tabs. llguidance's default (any run of
# whitespace) lets a small model pad forever (seen: a tiny target writing "\n" until max_tokens); this still
# allows pretty-printed JSON. A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"\n?[ \t]{0,32}"


class GrammarError(DFlashError):
    """The grammar engine refused a token the decode loop produced: a bug, never a user error."""


@dataclass(frozen=True)
class Grammar:
    """What constrained generation must produce; independent of any tokenizer (see `compile`)."""

    kind: str  # one of GRAMMAR_KINDS
    source: str = ""  # the JSON schema (JSON text), the regex or the Lark grammar; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidInputError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.source.strip():
            raise InvalidInputError(f"a {self.kind} grammar needs its text, got an empty one")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """JSON valid under `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidInputError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that matches `pattern` as a whole."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Exactly one of `options` (a Lark grammar of their literal texts)."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidInputError(f"choices must be a non-empty list of non-empty texts, got {options!r}")
        return cls("lark", "start: " + " | ".join(json.dumps(o) for o in options))

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Text in the language of a Lark grammar (llguidance's dialect; start rule `start`)."""
        return cls("lark", grammar)

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any] | None) -> Grammar | None:
        """The grammar of an OpenAI `response_format` ({"type": "text" | "json_object" | "json_schema"})."""
        if not response_format:
            return None
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise InvalidInputError(
                    'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
                )
            return cls.json_schema(spec["schema"])
        raise InvalidInputError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def llguidance_grammar(self) -> str:
        from llguidance import LLMatcher

        defaults = {"whitespace_pattern": JSON_WHITESPACE}
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """The llguidance view of a Hugging Face fast tokenizer (~1 s to build: keep it), with the model's
    vocabulary size (embedding rows past the tokenizer's are never allowed) and its end-of-sequence ids (the
    grammar allows them where the text is complete)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    except ValueError as exc:
        raise InvalidInputError(
            f"structured output needs a fast Hugging Face tokenizer llguidance can read: {exc}"
        ) from None


class CompiledGrammar:
    """A grammar checked against one tokenizer; `start()` gives each generation its own constraint."""

    def __init__(self, grammar: Grammar, llg_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        from llguidance import LLMatcher

        self.grammar, self.tokenizer, self.vocab_size = grammar, llg_tokenizer, vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text = grammar.llguidance_grammar()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(self.text, llg_tokenizer)
        if is_error:
            raise InvalidInputError(f"invalid {grammar.kind} grammar: {messages[0] if messages else 'rejected'}")

    @property
    def kind(self) -> str:
        return self.grammar.kind

    def start(self) -> TokenConstraint:
        from llguidance import LLMatcher

        return TokenConstraint(LLMatcher(self.tokenizer, self.text), self.vocab_size, self.eos_token_ids)


class TokenConstraint:
    """The grammar's state over one generation: which tokens may come next, advanced token by token.

    An end-of-sequence token ends the text: drafts stop after one, and the decode loop stops at it."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        from llguidance.torch import allocate_token_bitmask

        self.matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, eos_token_ids
        self._bitmask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"grammar engine error: {self.matcher.get_error()}")

    def allowed(self) -> Tensor:
        """[vocab] bool: the tokens the grammar allows next (end-of-sequence ids where the text is complete)."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask)
        self._check()
        # bit i of int32 word w is token 32w + i: little-endian words, little-endian bit order
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        if not bits.any():  # (numpy: a torch reduction this small can stall on a busy machine's threads)
            raise GrammarError("the grammar allows no next token")
        return torch.from_numpy(bits.view(np.bool_))  # [vocab]

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past emitted tokens (each one the grammar allowed)."""
        for token in tokens:
            if not self.matcher.consume_token(int(token)):
                raise GrammarError(f"the grammar refused token {int(token)}: {self.matcher.get_error()}")

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise GrammarError(f"the grammar engine could not roll back {n} tokens")

    def cut(self, drafts: Sequence[int]) -> tuple[int, Tensor]:
        """How many of `drafts` the grammar accepts in order (n), and the allowed sets before each of them and
        after the n-th: [n + 1, vocab] bool, the masks of the n + 1 verify rows. The state is left unchanged."""

        def next_draft(i: int, allowed: Tensor) -> int | None:
            return int(drafts[i]) if i < len(drafts) and allowed[int(drafts[i])] else None

        accepted, masks = self._walk(next_draft)
        return len(accepted), masks

    def propose(
        self, scores: Tensor, columns: Tensor | None, propose_row: Callable[[Tensor], tuple[Tensor, Tensor | None]]
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Draft from the drafter's scores [k, V'] (over the vocabulary ids `columns`; None: all), each row
        masked by the set allowed after the drafts before it. ``propose_row([1, V'] masked scores)`` -> (token
        [1], q [1, vocab] or None) proposes one token. Returns drafts [n <= k], their q [n, vocab] (None:
        one-hot) and the verify rows' masks [n + 1, vocab]; drafting stops early where the grammar allows none
        of the columns. The state is left unchanged."""
        cpu_columns = columns.cpu() if columns is not None else None  # the masks live on the CPU
        qs: list[Tensor | None] = []

        def next_draft(i: int, allowed: Tensor) -> int | None:
            ok = allowed if cpu_columns is None else allowed[cpu_columns]  # [V']
            if i >= scores.shape[0] or not ok.numpy().any():
                return None
            token, q = propose_row(scores[i : i + 1].masked_fill(~ok.to(scores.device), float("-inf")))  # [1, V']
            qs.append(q)
            return int(token[0])

        drafts, masks = self._walk(next_draft)
        q = torch.cat(qs) if qs and qs[0] is not None else None  # type: ignore[arg-type]
        return torch.tensor(drafts, dtype=torch.long, device=scores.device), q, masks

    def _walk(self, next_draft: Callable[[int, Tensor], int | None]) -> tuple[list[int], Tensor]:
        """Drafts chosen one by one, ``next_draft(i, allowed [vocab])`` -> a token the grammar allows or None (stop),
        with the allowed set before each and after the last: ([n] drafts, [n + 1, vocab] masks). The state is left
        unchanged. An end-of-sequence draft ends the walk; the row behind it may hold any token (the text ends
        there, so its token is never emitted), and the matcher does not consume it: llguidance counts an
        end-of-sequence token apart from the others, and a rollback over it would take one token too many."""
        masks = [self.allowed()]
        drafts: list[int] = []
        consumed = 0
        while (token := next_draft(len(drafts), masks[-1])) is not None:
            drafts.append(token)
            if token in self.eos_token_ids:
                masks.append(torch.ones_like(masks[-1]))
                break
            self.consume([token])
            consumed += 1
            masks.append(self.allowed())
        self.rollback(consumed)
        return drafts, torch.stack(masks)


def masked(logits: Tensor, masks: Tensor | None) -> Tensor:
    """logits [..., vocab] with -inf where masks [..., vocab] (bool) is False (None: unchanged)."""
    if masks is None:
        return logits
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))
