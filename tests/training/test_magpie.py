"""Magpie prompts (dflashkit.training.magpie): the target's own requests, seeded, within budget, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashkit.errors import InvalidInputError
from dflashkit.text import encode_chat
from dflashkit.training import answerer as answering
from dflashkit.training import magpie
from tests.training.test_sources import EOS, RecordingAnswerer, make_model, make_tokenizer


def test_user_turn_prefix_is_the_template_before_a_users_text() -> None:
    tok = make_tokenizer()
    prefix = magpie.user_turn_prefix(tok)
    assert prefix == tok.encode("user", add_special_tokens=False)
    assert encode_chat(tok, "hello world")[: len(prefix)] == prefix  # what any user turn starts with
    bare = make_tokenizer()
    bare.chat_template = None
    with pytest.raises(InvalidInputError, match="chat template"):
        magpie.user_turn_prefix(bare)
    bare.chat_template = "{% for m in messages %}{{ m['role'] }} says something {% endfor %}"  # drops the text
    with pytest.raises(InvalidInputError, match="as given"):
        magpie.user_turn_prefix(bare)
    steered = magpie.user_turn_prefix(tok, "Users ask for Python functions.")  # a system turn before the user's
    assert steered == tok.encode("system Users ask for Python functions. user", add_special_tokens=False)
    bare.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    assert magpie.user_turn_prefix(bare) == []
    with pytest.raises(InvalidInputError, match="system prompt"):  # drops system turns: it cannot be steered
        magpie.user_turn_prefix(bare, "Users ask for Python functions.")


@pytest.mark.parametrize("engine", ["continuous", "static", "batches"])
def test_magpie_prompts_are_the_targets_own_ended_requests_seeded_and_within_budget(engine: str) -> None:
    model, tok = make_model(), make_tokenizer()

    def run(seed: int, budget: int | None, max_tokens: int = 6):
        answerer = RecordingAnswerer.for_target(model, tok, engine=engine, batch_size=4)
        answerer.given = []
        source = magpie.magpie_prompts(answerer, tok, seed=seed, budget=budget, max_tokens=max_tokens)
        return (list(source) if budget is not None else [next(source) for _ in range(5)]), answerer.given

    texts, given = run(0, 10)
    prefix = magpie.user_turn_prefix(tok)
    assert len(given) == 10 and all(ids == prefix for _, ids, _ in given)  # the budget: 10 requests written
    ended = [r for _, _, r in sorted(given) if r and r[-1] == EOS]
    assert 0 < len(ended) < 10  # the tiny model ends some turns within 6 tokens and not others
    assert texts == [t for t in (tok.decode(r[:-1], skip_special_tokens=True).strip() for r in ended) if t]
    assert all(len(r) <= 6 for _, _, r in given)
    assert run(0, 10)[0] == texts  # seeded
    assert run(1, 10)[0] != texts
    assert run(0, 0) == ([], [])
    endless, given = run(0, None, max_tokens=20)  # no budget: as many as asked for
    assert len(endless) == 5 and len(given) % 4 == 0


def test_magpie_rounds_file_resumes_a_killed_collection_with_the_same_requests(tmp_path: Path) -> None:
    model, tok = make_model(), make_tokenizer()
    clean = list(
        magpie.magpie_prompts(
            answering.Answerer.for_target(model, tok, engine="continuous", batch_size=4),
            tok,
            seed=3,
            budget=40,
            max_tokens=6,
        )
    )  # rounds of 16, 16 and 8 requests
    rounds_file = tmp_path / "requests.jsonl"

    class Killed(RecordingAnswerer):
        def answers(self, encoded, **kwargs):
            if kwargs["group"] == 1:
                raise KeyboardInterrupt  # killed while writing the second round
            yield from super().answers(encoded, **kwargs)

    killed = Killed.for_target(model, tok, engine="continuous", batch_size=4)
    killed.given = []
    with pytest.raises(KeyboardInterrupt):
        list(magpie.magpie_prompts(killed, tok, seed=3, budget=40, max_tokens=6, rounds_file=rounds_file))
    assert len(rounds_file.read_text().splitlines()) == 2  # the settings and the first round
    with rounds_file.open("a") as f:
        f.write('{"count": 16, "requests": ["torn')  # a line cut by the kill
    again = RecordingAnswerer.for_target(model, tok, engine="continuous", batch_size=4)
    again.given = []
    resumed = list(magpie.magpie_prompts(again, tok, seed=3, budget=40, max_tokens=6, rounds_file=rounds_file))
    assert resumed == clean and sorted(label for label, _, _ in again.given) == list(range(16, 40))  # round 1 on
    again.given = []  # complete: replayed whole, nothing written again
    assert list(magpie.magpie_prompts(again, tok, seed=3, budget=40, max_tokens=6, rounds_file=rounds_file)) == clean
    assert again.given == [] and len(rounds_file.read_text().splitlines()) == 4
    other = list(magpie.magpie_prompts(again, tok, seed=4, budget=40, max_tokens=6, rounds_file=rounds_file))
    assert len(again.given) == 40 and other != clean  # another seed: not replayed, the file starts over
    assert json.loads(rounds_file.read_text().splitlines()[0])["settings"]["seed"] == 4
