"""A multi-turn conversation with a generator, each turn prefilling only what is new (``dflashkit chat``).

Every turn sends the whole conversation through the chat template, as a chat client does; the session's
:class:`~dflashkit.prefix_cache.PrefixCache` restores what the previous turn computed (its prompt and answer), so a
turn costs its new message and its answer, not the history.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .errors import InvalidInputError
from .generator import GenerationResult, SpeculativeGenerator
from .prefix_cache import PrefixCache


class ChatSession:
    """The messages of one conversation and the cache its turns share; ``options`` are :meth:`stream`'s."""

    def __init__(self, generator: SpeculativeGenerator, system: str | None = None,
                 prefix_cache: PrefixCache | bool = True, **options: Any) -> None:
        """``prefix_cache``: True (a new 256 MiB cache), False (none: every turn prefills it all) or a cache."""
        if "chat" in options:
            raise InvalidInputError("a chat session sends its messages through the chat template")
        if not isinstance(prefix_cache, (PrefixCache, bool)):
            raise InvalidInputError(f"prefix_cache must be a PrefixCache, True or False, got {prefix_cache!r}")
        self.generator, self.system, self.options = generator, system, options
        self.cache = (PrefixCache.of_mib(256) if prefix_cache is True
                      else None if prefix_cache is False else prefix_cache)  # (an empty cache is falsy: len 0)
        self.messages: list[dict[str, str]] = []
        self.last: GenerationResult | None = None  # the last turn's result (None when it was interrupted)
        self.reset()

    def reset(self) -> None:
        """Start a new conversation (the cache keeps what it holds: a later turn that shares a prefix reuses it)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last = None

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
        try:
            stream = self.generator.stream(self.messages, prefix_cache=self.cache, **self.options)
            for delta in stream:
                pieces.append(delta.text)
                yield delta.text
            self.last = stream.result
        finally:
            if stream is not None and self.last is None:
                stream.close()  # cut short: the generation stops here (and keeps its cache for the next turn)
            if pieces:
                self.messages.append({"role": "assistant", "content": "".join(pieces)})
            else:
                self.messages.pop()
