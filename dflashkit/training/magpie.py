"""Magpie prompts: the target writes user turns itself from its chat template's user-turn prefix."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import torch

from dflashkit.decoding.sampling import SamplingParams
from dflashkit.errors import InvalidInputError
from dflashkit.fsutil import atomic_write
from dflashkit.training.answerer import Answerer

MAGPIE_TEMPERATURE = 1.0  # the target writes the user's turn at these settings


MAGPIE_TOP_P = 0.95  # trims the tail of a small target's vocabulary: fewer garbled requests


MAGPIE_MAX_TOKENS = 128  # a request not ended by then is dropped (usually a letter or a story, not a request)


MAGPIE_ROUND = 4  # requests written per round, in answerer.batch_size's: slots freed by short ones take the next


MAGPIE_BUDGET = 2  # collect_prompts asks for at most 2 n + 64 requests: a target that repeats itself or never


#                    ends its turn runs the source dry instead of looping
# the magpie sources and the system prompt each writes its requests under (None: the template's default). Only the
# request is kept: it is answered like any prompt, under the default system prompt. Measured on SmolLM2-135M-Instruct
# (32 requests each): the code prompt turns most requests into "write a function that..." ones (25 of 32 ended);
# math prompts tried did not steer it (a few problems among advice and chat), so math stays with the `math` source.
MAGPIE_SYSTEMS: dict[str, str | None] = {
    "magpie": None,
    "magpie-code": "You are an expert Python programmer. Users ask you to write or complete Python functions.",
}


def user_turn_prefix(tokenizer: Any, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to where a user's text begins (with ``system`` as the system prompt, else
    the template's default one): what an instruction-tuned model continues with a request of the kind it was tuned
    on, or of the kind the system prompt says its users ask."""
    marker = "\u2063dflashkit-user-turn\u2063"
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("the magpie source needs the target's chat template, and its tokenizer has none")
    messages = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": marker}], tokenize=False)
    if not isinstance(text, str) or text.count(marker) != 1:
        raise InvalidInputError(
            "the magpie source needs a chat template that writes a user's text as given; this one does not"
        )
    if system and system not in text[: text.index(marker)]:
        raise InvalidInputError(
            "this chat template does not write a system prompt as given: a steered magpie source "
            "(magpie-code) cannot use it"
        )
    return list(tokenizer.encode(text[: text.index(marker)], add_special_tokens=False))


def magpie_prompts(
    answerer: Answerer,
    tokenizer: Any,
    *,
    seed: int = 0,
    budget: int | None = None,
    temperature: float = MAGPIE_TEMPERATURE,
    top_p: float = MAGPIE_TOP_P,
    max_tokens: int = MAGPIE_MAX_TOKENS,
    system: str | None = None,
    rounds_file: str | os.PathLike | None = None,
    progress: bool = False,
) -> Iterator[str]:
    """Requests written by the target itself (Magpie, Xu et al. 2024): given only the chat template up to a user's
    text (:func:`user_turn_prefix`), an instruction-tuned model writes a user's request of the kind it was tuned on,
    and ends the turn with its end-of-turn token. No data set is needed, the supply is unlimited, and the requests
    follow the target's own idea of what users ask. Sampled (``temperature``, ``top_p``) through ``answerer``
    (``answerer.batch_size`` decoding at once, ``MAGPIE_ROUND`` times as many per round), seeded: deterministic for a
    seed, engine and batch size. A request that does not end within ``max_tokens`` is dropped; at most ``budget``
    requests are written (None: no limit). ``system``: a system prompt that steers the kind of request
    (:data:`MAGPIE_SYSTEMS`); the request alone is returned.

    ``rounds_file``: each round's requests are appended to it (synced) as the round ends, and a later call with the
    same file and settings replays the rounds stored there before writing new ones, so the same requests come out
    and a killed collection loses at most the round in progress."""
    if budget is not None and budget < 0:
        raise InvalidInputError(f"budget must be >= 0, got {budget}")
    prefix = user_turn_prefix(tokenizer, system)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    eos = set(answerer.eos_ids)
    settings = {
        "seed": seed,
        "system": system,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "engine": answerer.engine,
        "batch_size": answerer.batch_size,
        "prefix": prefix,
    }
    rounds = _MagpieRounds(rounds_file, settings) if rounds_file is not None else None
    from tqdm.auto import tqdm

    written, group = 0, 0
    desc = "writing prompts (magpie)" if budget is None else f"writing prompts (magpie, at most {budget})"
    with tqdm(unit="prompt", desc=desc, disable=not progress, dynamic_ncols=True) as bar:  # a count: sources stop early
        while budget is None or written < budget:
            count = MAGPIE_ROUND * answerer.batch_size
            count = count if budget is None else min(count, budget - written)
            texts = rounds.replay(group, count) if rounds is not None else None
            if texts is None:
                encoded = [(written + j, prefix) for j in range(count)]
                with torch.random.fork_rng(devices=answerer.rng_devices), torch.inference_mode():
                    rows = sorted(
                        (label, response)
                        for answered in answerer.answers(
                            encoded, seed=seed, group=group, max_new_tokens=max_tokens, sampling=sampling
                        )
                        for label, _, response in answered
                    )
                ended = (
                    tokenizer.decode(r[:-1], skip_special_tokens=True).strip() for _, r in rows if r and r[-1] in eos
                )
                texts = [text for text in ended if text]
                if rounds is not None:
                    rounds.store(group, count, texts)
            written, group = written + count, group + 1
            bar.update(count)
            yield from texts


class _MagpieRounds:
    """The rounds of requests a :func:`magpie_prompts` call has written, in a JSON-lines file: a header with the
    settings, then one line per round (``count`` requests asked for, the ``requests`` kept). Rounds stored under other
    settings are not replayed (the file starts over); a line torn by a kill is ignored."""

    def __init__(self, path: str | os.PathLike, settings: dict[str, Any]) -> None:
        self.path, self.settings = pathlib.Path(path), settings
        self.rounds: list[tuple[int, list[str]]] = []
        self.valid = False  # the file on disk holds this header and exactly self.rounds
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            if lines and json.loads(lines[0]).get("settings") == settings:
                for line in lines[1:]:
                    record = json.loads(line)
                    self.rounds.append((int(record["count"]), [str(t) for t in record["requests"]]))
                self.valid = True
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, AttributeError):  # a torn last line: the rounds before it stand
            pass

    def replay(self, index: int, count: int) -> list[str] | None:
        """Round ``index``'s requests if it is stored with this ``count``, else None (it is to be written)."""
        if index < len(self.rounds) and self.rounds[index][0] == count:
            return self.rounds[index][1]
        return None

    def store(self, index: int, count: int, requests: list[str]) -> None:
        if not self.valid or index != len(self.rounds):  # other settings, a torn line or later rounds: rewrite
            self.rounds = self.rounds[:index]
            atomic_write(
                self.path,
                lambda f: f.write(
                    "".join(
                        json.dumps(x, ensure_ascii=False) + "\n"
                        for x in [{"settings": self.settings}] + [{"count": c, "requests": r} for c, r in self.rounds]
                    )
                ),
            )
            self.valid = True
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"count": count, "requests": requests}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rounds.append((count, requests))
