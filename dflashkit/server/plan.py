"""A validated request ready to queue (Plan), and what a response echoes of it (Echo)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashkit.decoding.grammar import CompiledGrammar
from dflashkit.server.schemas import GenerationRequest
from dflashkit.tool_calls import ToolRequest


@dataclass
class Plan:
    """A validated request, ready to queue: one prompt (chat), or the completions prompts in order."""

    body: GenerationRequest
    chat: bool
    prompts: list[list[int]]  # token ids of each prompt
    max_new_tokens: list[int]  # per prompt
    arrived: float
    grammar: CompiledGrammar | None = None  # response_format, checked against the tokenizer
    logit_bias: dict[int, float] = field(default_factory=dict)
    echoes: list[Echo] | None = None  # completions with echo: each prompt, to put before its completions
    tools: ToolRequest | None = None  # chat: the request's tools (calls are parsed out of the answer when active)
    tenant: str = ""  # the client's id (its API key's; "" without keys): its prefix-cache sequences are its own

    @property
    def generations(self) -> int:
        """Generations to run: every prompt's n choices (or best_of candidates), one after another."""
        return len(self.prompts) * self.body.candidates


@dataclass
class Echo:
    """A completions prompt to echo: its text, token ids and the text each token releases (for text_offset)."""

    text: str
    token_ids: list[int]
    pieces: list[str]
