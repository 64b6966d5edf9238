"""A multi-turn conversation with a generator, each turn prefilling only what is new (``dflashkit chat``).

Every turn sends the whole conversation through the chat template, as a chat client does; the session's
:class:`~dflashkit.decoding.prefix_cache.PrefixCache` restores what the previous turn computed (its prompt and answer),
so a
turn costs its new message and its answer, not the history. A chat client re-encodes the answer's text, which may
give other tokens than the model wrote (SmolLM2 writes "\\n\\n" as one token where its tokenizer, before a digit,
writes two), and reuse ends at the first token that differs; a session knows the tokens, so its next prompt is the
previous prompt's tokens + the answer's own tokens + the template's tokens after them, whenever the template renders
the conversation that way (:func:`continued_prompt`; otherwise the template's text, encoded).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dflashkit.decoding.prefix_cache import PrefixCache
from dflashkit.errors import InvalidInputError
from dflashkit.generator import GenerationResult, SpeculativeGenerator
from dflashkit.text import render_chat


def continued_prompt(tokenizer: Any, text: str, previous: tuple[str, list[int], list[int]]) -> list[int] | None:
    """The token ids of a conversation's next prompt, whose template text is ``text``, given ``previous`` = (the
    last prompt's text, its token ids, the answer's token ids without a final stop token): those ids, the
    answer's own tokens, then the template's text after the answer, encoded. None when ``text`` does not begin
    with the last prompt's text + the answer's text (a template that rewrites earlier turns, a cut answer)."""
    last_text, last_ids, answer_ids = previous
    head = last_text + tokenizer.decode(answer_ids, skip_special_tokens=True)
    if not text.startswith(head):
        return None
    return [*last_ids, *answer_ids, *tokenizer.encode(text[len(head) :], add_special_tokens=False)]


def completed_turn(
    prompt_text: str, prompt_ids: list[int], result: GenerationResult, eos_token_ids: list[int]
) -> tuple[str, list[int], list[int]]:
    """A finished turn as :func:`continued_prompt` takes it: the prompt's text and ids, the answer's ids without
    its final stop tokens (the template writes its own end of turn)."""
    answer = list(result.token_ids)
    while answer and answer[-1] in eos_token_ids:
        answer.pop()
    return prompt_text, prompt_ids, answer


class ChatSession:
    """The messages of one conversation and the cache its turns share; ``options`` are :meth:`stream`'s."""

    def __init__(
        self,
        generator: SpeculativeGenerator,
        system: str | None = None,
        prefix_cache: PrefixCache | bool = True,
        **options: Any,
    ) -> None:
        """``prefix_cache``: True (a new 256 MiB cache), False (none: every turn prefills it all) or a cache."""
        if "chat" in options:
            raise InvalidInputError("a chat session sends its messages through the chat template")
        if not isinstance(prefix_cache, (PrefixCache, bool)):
            raise InvalidInputError(f"prefix_cache must be a PrefixCache, True or False, got {prefix_cache!r}")
        self.generator, self.system, self.options = generator, system, options
        self.cache = (
            PrefixCache.of_mib(256) if prefix_cache is True else None if prefix_cache is False else prefix_cache
        )  # (an empty cache is falsy: len 0)
        self.messages: list[dict[str, str]] = []
        self.last: GenerationResult | None = None  # the last turn's result (None when it was interrupted)
        self._previous: tuple[str, list[int], list[int]] | None = None  # last prompt's text, ids; answer ids
        self.reset()

    def reset(self) -> None:
        """Start a new conversation (the cache keeps what it holds: a later turn that shares a prefix reuses it)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last, self._previous = None, None

    def _prompt(self) -> tuple[str | None, list[int]]:
        """The next prompt's template text (None: no template) and token ids."""
        text = render_chat(self.generator.tokenizer, self.messages)
        ids = None
        if text is not None and self._previous is not None:
            ids = continued_prompt(self.generator.tokenizer, text, self._previous)
        return text, ids if ids is not None else self.generator.encode_prompt(self.messages)

    def send(self, text: str) -> Iterator[str]:
        """Ask ``text``; yields the answer's text as it is generated. The answer joins the conversation when the
        iteration ends, also when it is cut short (a KeyboardInterrupt); a turn that failed before any text (e.g.
        a conversation past the target's context) leaves the conversation as it was and raises."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError("a chat message must be non-empty text")
        self.messages.append({"role": "user", "content": text})
        self.last = None
        pieces: list[str] = []
        stream = None
        completed = None  # this turn's (prompt text, prompt ids, answer ids), for the next prompt
        try:
            prompt_text, ids = self._prompt()
            stream = self.generator.stream(ids, prefix_cache=self.cache, **self.options)
            for delta in stream:
                pieces.append(delta.text)
                yield delta.text
            self.last = stream.result
            if prompt_text is not None:
                completed = completed_turn(prompt_text, ids, self.last, self.generator.eos_token_ids)
        finally:
            if stream is not None and self.last is None:
                stream.close()  # cut short: the generation stops here (and keeps its cache for the next turn)
            if pieces:
                self.messages.append({"role": "assistant", "content": "".join(pieces)})
                self._previous = completed  # None after a cut answer: the next prompt is encoded from the text
            else:
                self.messages.pop()
