"""The playground page in headless Chromium (Debian's `chromium`, driven by Playwright): it renders, streams
a reply token by token, colours each token by origin (the drafter's, a prompt-lookup copy, the target's) and
shows the final stats; the API key box shows only for a server started with an API key."""

from __future__ import annotations

import os
import shutil

import pytest

from dflashkit.server import create_app
from tests.live_server import LiveServer, tiny_generator

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extra)")
CHROMIUM = os.environ.get("DFLASHKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium; scripts/setup.sh does it)"
)

MODEL = "tiny-llama"
PROMPT = "w5 w6 w7"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(browser):
    # a fixed block, no prompt lookup: the token origins and τ are compared with an offline run's
    app = create_app(tiny_generator(), model_id=MODEL, proposal="sample", block_size=4, lookup=False)
    with LiveServer(app) as live:
        page = browser.new_page()
        page.goto(live.url + "/")
        yield page


def run(page, *, mode: str, temperature: float, seed: int, max_tokens: int) -> None:
    page.select_option("#mode", mode)
    page.fill("#prompt", PROMPT)
    page.fill("#temperature", str(temperature))
    page.fill("#seed", str(seed))
    page.fill("#max-tokens", str(max_tokens))
    # count the separate updates of the output while it streams
    page.evaluate("""() => {
        window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
            .observe(document.getElementById('output'), {childList: true});
    }""")
    page.click("#send")
    page.wait_for_function("() => document.getElementById('status').textContent.startsWith('done')", timeout=30_000)


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_playground_streams_coloured_tokens_and_stats(page, mode: str) -> None:
    assert "dflashkit playground" in page.title()
    page.wait_for_function(f"() => document.getElementById('model').textContent.includes('{MODEL}')")
    assert "speculative, block size 4" in page.inner_text("#model")

    reference = tiny_generator()
    prompt = [{"role": "user", "content": PROMPT}] if mode == "chat" else PROMPT
    expected = reference.generate(
        prompt,
        chat=mode == "chat",
        temperature=1.0,
        seed=11,
        max_new_tokens=40,
        proposal="sample",
        block_size=4,
        lookup=False,
    )
    assert any(expected.from_draft) and not all(expected.from_draft)  # both colours must show

    run(page, mode=mode, temperature=1.0, seed=11, max_tokens=40)
    tokens = rendered(page)
    assert "".join(t for t, _ in tokens) == expected.text == page.inner_text("#output")
    assert [o for _, o in tokens] == expected.origins  # no prompt lookup: drafter or target
    assert [o == "drafter" for _, o in tokens] == expected.from_draft
    titles = page.eval_on_selector_all("#output .tok", "els => els.map(e => e.title)")
    logprobs = reference.generate(
        prompt,
        chat=mode == "chat",
        temperature=1.0,
        seed=11,
        max_new_tokens=40,
        proposal="sample",
        block_size=4,
        lookup=False,
        logprobs=3,
    ).logprobs
    assert [float(t.split("logprob ")[1].split(" ")[0]) for t in titles] == pytest.approx(
        [lp.logprob for lp in logprobs], abs=1e-3
    )  # the hover text: the token's logprob and its alternatives
    assert all(t.count(",") == 2 for t in titles)
    colours = {
        page.eval_on_selector(sel, "e => getComputedStyle(e).backgroundColor")
        for sel in ("#output .tok.drafter", "#output .tok.target")
    }
    assert len(colours) == 2  # drawn differently
    # the reply was rendered in pieces; events that arrive in one network read are rendered in one task and
    # observed as one update, so a loaded machine sees fewer updates than steps (a full run failed this test once
    # under load, assertion not captured; this is the load-sensitive check)
    assert page.evaluate("window.updates") >= 2
    assert page.inner_text("#tau") == f"{expected.stats.tau:.2f}"
    assert int(page.inner_text("#ntokens")) == len(expected.token_ids)
    assert int(page.inner_text("#nsteps")) == expected.stats.steps
    assert int(page.inner_text("#ndraft")) == sum(expected.from_draft)
    assert int(page.inner_text("#ncopy")) == 0
    assert int(page.inner_text("#ntarget")) == len(expected.token_ids) - sum(expected.from_draft)
    assert "τ: tokens per target pass; 1 = plain decoding" in page.inner_text("#tau-note")
    assert float(page.inner_text("#tps")) > 0
    assert page.inner_text("#status") == f"done ({expected.finish_reason})"
    assert "accepted / drafted per block position" in page.inner_text("#positions")
    assert page.inner_text("#error") == ""


def rendered(page) -> list[tuple[str, str]]:
    """The output's tokens: (text, origin), the origin read from the one class besides "tok" each carries."""
    spans = page.eval_on_selector_all("#output .tok", "els => els.map(e => [e.textContent, [...e.classList]])")
    for _, classes in spans:
        assert classes[0] == "tok" and len(classes) == 2  # exactly one origin class
    return [(text, classes[1]) for text, classes in spans]


def test_playground_tells_copies_from_drafts(browser) -> None:
    """With prompt lookup on and a prompt that repeats itself, copied tokens get their own colour and count:
    the page shows the origins the library reports, and drafter + copy tokens are the accepted drafts."""
    settings = {"proposal": "sample", "block_size": 4, "lookup": True}  # fixed block: equal to an offline run
    prompt = "w5 w6 w7 w8 w9 w5 w6 w7 w8 w9 w5 w6 w7"
    expected = tiny_generator().generate(
        [{"role": "user", "content": prompt}], temperature=1.0, seed=0, max_new_tokens=40, **settings
    )
    assert set(expected.origins) == {"drafter", "copy", "target"}  # all three colours must show
    with LiveServer(create_app(tiny_generator(), model_id=MODEL, **settings)) as live:
        page = browser.new_page()
        page.goto(live.url + "/")
        page.wait_for_function("() => document.getElementById('model').textContent.includes('prompt lookup')")
        page.fill("#prompt", prompt)
        page.fill("#temperature", "1")
        page.fill("#seed", "0")
        page.fill("#max-tokens", "40")
        page.click("#send")
        page.wait_for_function("() => document.getElementById('status').textContent.startsWith('done')")
        tokens = rendered(page)
        assert "".join(t for t, _ in tokens) == expected.text
        assert [o for _, o in tokens] == expected.origins
        counts = {
            o: int(page.inner_text(f"#{i}"))
            for o, i in (("drafter", "ndraft"), ("copy", "ncopy"), ("target", "ntarget"))
        }
        assert counts == {o: expected.origins.count(o) for o in ("drafter", "copy", "target")}
        assert counts["drafter"] + counts["copy"] == sum(expected.stats.accepted_lengths)
        colours = {
            page.eval_on_selector(f"#output .tok.{o}", "e => getComputedStyle(e).backgroundColor") for o in counts
        }
        assert len(colours) == 3  # drawn differently
        legend = page.eval_on_selector_all(".legend .tok", "els => els.map(e => e.className)")
        assert legend == ["tok drafter", "tok copy", "tok target"]


def test_playground_shows_errors(page) -> None:
    page.select_option("#mode", "chat")
    page.fill("#prompt", " ".join(["w5"] * 600))  # longer than the context
    page.fill("#max-tokens", "5")
    page.click("#send")
    page.wait_for_function("() => document.getElementById('status').textContent === 'error'", timeout=30_000)
    assert "context length" in page.inner_text("#error")
    assert page.is_enabled("#send")


def test_playground_conversation_continues_and_restores_earlier_turns(page) -> None:
    """With "conversation" on, each reply joins the conversation shown above the output and the next prompt
    continues it: the server restores the earlier turns (the "restored" stat), and the reply is what an offline
    run of the whole conversation gives; "New conversation" forgets it."""
    page.check("#conversation")
    run(page, mode="chat", temperature=0.0, seed=1, max_tokens=12)
    first = page.inner_text("#output")
    assert page.input_value("#prompt") == "" and page.inner_text("#cached") == "0"
    page.fill("#prompt", "w8 w9")
    page.click("#send")
    page.wait_for_function("() => document.getElementById('status').textContent.startsWith('done')", timeout=30_000)
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "w8 w9"},
    ]
    expected = tiny_generator().generate(messages, temperature=0.0, max_new_tokens=12)
    assert page.inner_text("#output") == expected.text
    assert int(page.inner_text("#nprompt")) == expected.prompt_tokens
    assert 0 < int(page.inner_text("#cached")) < expected.prompt_tokens
    turns = page.eval_on_selector_all("#history .turn", "els => els.map(e => [e.className, e.textContent])")
    assert turns == [
        ["turn user", PROMPT],
        ["turn assistant", first],
        ["turn user", "w8 w9"],
        ["turn assistant", expected.text],
    ]
    page.click("#new-chat")
    assert page.eval_on_selector_all("#history .turn", "els => els.length") == 0
    page.uncheck("#conversation")


def test_playground_hides_the_key_box_of_a_server_without_a_key(page) -> None:
    """Without --api-key there is no key to type: the box stays hidden (its flex layout must not override
    the hidden attribute)."""
    page.wait_for_function(f"() => document.getElementById('model').textContent.includes('{MODEL}')")
    assert page.eval_on_selector("#key-box", "e => e.hidden")
    assert not page.is_visible("#key-box") and not page.is_visible("#api-key")


def test_playground_asks_for_the_api_key_of_a_server_that_needs_one(browser) -> None:
    """With --api-key the page says so and shows a key box; the typed key goes with its requests."""
    app = create_app(tiny_generator(), model_id=MODEL, api_key="sekret")
    with LiveServer(app) as live:
        page = browser.new_page()
        page.goto(live.url + "/")
        page.wait_for_function("() => document.getElementById('model').textContent.includes('API key')")
        assert page.is_visible("#key-box") and page.is_visible("#api-key")
        page.fill("#api-key", "sekret")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function(f"() => document.getElementById('model').textContent.includes('{MODEL}')")
        assert "speculative, " in page.inner_text("#model")  # /health, asked with the key: the settings
        run(page, mode="chat", temperature=0.0, seed=1, max_tokens=6)
        expected = tiny_generator().generate([{"role": "user", "content": PROMPT}], max_new_tokens=6)
        assert page.inner_text("#output") == expected.text
