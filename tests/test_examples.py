"""The programs in examples/ run as written, each in its own process with small limits.

prefix_cache_chat.py and responses_chat.py run on the embedded default target and its shipped drafter; tool_calls.py
needs a target whose chat template writes <tool_call> blocks, so it runs on a tiny random model saved with such a
template (its answers are noise, but every request and the server's tool handling go through).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 300  # generous for a first run that converts the default target or builds the CPU kernels


def run_example(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def test_every_example_is_tested_and_documented() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    tested = Path(__file__).read_text()
    for example in sorted(EXAMPLES.glob("*.py")):
        assert f"`{example.name}`" in readme, f"{example.name} is not in examples/README.md"
        assert f'"{example.name}"' in tested, f"{example.name} has no test here"


def test_prefix_cache_chat() -> None:
    out = run_example("prefix_cache_chat.py", "--turns", "2", "--max-new-tokens", "8", "--compare", "--threads", "2")
    restored = [int(n) for n in re.findall(r"(\d+) restored from the cache", out)]
    assert len(restored) == 2, out
    assert restored[1] > 0, out  # the second turn begins with the first turn and its answer: restored
    assert out.count("without the cache:") == 2, out


def test_responses_chat() -> None:
    out = run_example("responses_chat.py", "--turns", "2", "--max-new-tokens", "8", "--threads", "2")
    restored = [int(n) for n in re.findall(r"prompt tokens, (\d+) restored", out)]
    assert len(restored) == 4, out  # two turns through each API
    assert restored[1] > 0, out  # the Responses API's second turn continues the stored first one


@pytest.fixture
def tool_target(tmp_path: Path) -> Path:
    """A tiny random llama over a byte-level tokenizer (it can spell any tool call), with a chat template in the
    Qwen2.5 / Hermes <tool_call> convention, saved as a model folder."""
    from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_target
    from tests.live_server import TOOLS_TEMPLATE

    model = tiny_target("llama", vocab_size=BYTE_VOCAB, max_position_embeddings=2048)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_tool_calls(tool_target: Path) -> None:
    out = run_example("tool_calls.py", "--target", str(tool_target), "--max-tokens", "48", "--threads", "2")
    steps = ("1. weather, auto", "3. joke, required, streamed", "4. joke, auto", "5. Responses API", "6. Messages API")
    for step in steps:
        assert step in out, out
    # tool_choice "required": the grammar makes the answer a call of the one tool offered (cut short by max_tokens,
    # a call this random model begins comes back as text)
    required = next(line for line in out.splitlines() if line.startswith("3. joke, required"))
    assert "get_weather" in required, out
