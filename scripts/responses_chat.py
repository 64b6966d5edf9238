"""Multi-turn chats through the server: chat completions re-sending the conversation vs the Responses API with
previous_response_id, each on its own server (own prefix cache) over the same model, interleaved per chat.

    .venv/bin/python scripts/responses_chat.py [--chats 4] [--turns 3] [--max-new-tokens 128] [--threads 2]

Each chat is an MT-Bench question's two turns plus "Summarise your answers so far in two sentences."; each mode
continues its own conversation (its own answers). Default target and drafter with the server's defaults, greedy,
streamed. Prints per turn and mode the median prompt tokens, tokens restored from the prefix cache and time to the
first token, and how many answers of the two modes were equal (they may part where the Responses API's prompt keeps
the model's own tokens and chat's re-encoded text gives others).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import openai
import torch
import uvicorn

from dflashkit import SpeculativeGenerator
from dflashkit.bench.datasets import load_questions
from dflashkit.interop.llama_server import free_port
from dflashkit.server import create_app

FOLLOW_UP = "Summarise your answers so far in two sentences."
MODEL = "smollm2"


def serve(gen: SpeculativeGenerator) -> tuple[uvicorn.Server, threading.Thread, openai.OpenAI]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(gen, model_id=MODEL, block_size="auto", lookup=True),
            port=port,
            log_level="warning",
            log_config=None,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=600)


def chat_turn(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, int, int, float]:
    """(answer, prompt tokens, restored tokens, seconds to the first token) of one streamed chat request."""
    t0, first, text, usage = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(text), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, first or 0.0


def responses_turn(
    client: openai.OpenAI, user: str, previous: str | None, max_tokens: int
) -> tuple[str, int, int, float, str]:
    """(answer, prompt tokens, restored tokens, seconds to the first token, response id) of one streamed turn."""
    t0, first, final = time.perf_counter(), None, None
    for event in client.responses.create(
        model=MODEL, input=user, previous_response_id=previous, temperature=0, max_output_tokens=max_tokens, stream=True
    ):
        if event.type == "response.output_text.delta" and event.delta:
            first = first or time.perf_counter() - t0
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None
    usage = final.usage
    return (final.output_text, usage.input_tokens, usage.input_tokens_details.cached_tokens, first or 0.0, final.id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load()
    gen.warmup()
    _, questions = load_questions("mt-bench", limit=args.chats, seed=1)
    servers = {mode: serve(gen) for mode in ("chat", "responses")}  # one model, two servers: two prefix caches
    rows: dict[tuple[int, str], list[tuple[int, int, float]]] = {}
    same = total = 0
    try:
        for c, question in enumerate(questions):
            turns = [*question.turns, FOLLOW_UP][: args.turns]
            messages: list[dict[str, str]] = []
            previous = None
            for t, user in enumerate(turns):
                messages.append({"role": "user", "content": user})
                answers = {}
                for mode in ("chat", "responses") if c % 2 == 0 else ("responses", "chat"):
                    client = servers[mode][2]
                    if mode == "chat":
                        answer, prompt, cached, ttft = chat_turn(client, messages, args.max_new_tokens)
                    else:
                        answer, prompt, cached, ttft, previous = responses_turn(
                            client, user, previous, args.max_new_tokens
                        )
                    answers[mode] = answer
                    rows.setdefault((t, mode), []).append((prompt, cached, ttft))
                messages.append({"role": "assistant", "content": answers["chat"]})
                same += answers["chat"] == answers["responses"]
                total += 1
                print(f"chat {c + 1} turn {t + 1}: " + ", ".join(
                    f"{mode} {rows[(t, mode)][-1][1]}/{rows[(t, mode)][-1][0]} restored, "
                    f"first token {rows[(t, mode)][-1][2] * 1000:.0f} ms" for mode in ("chat", "responses")),
                    flush=True)  # fmt: skip
                if answers["chat"] != answers["responses"]:
                    break  # the conversations differ from here on: compare no further turns of this chat
    finally:
        for server, thread, _ in servers.values():
            server.should_exit = True
            thread.join(30)
    print(
        f"\n{args.chats} MT-Bench chats x up to {args.turns} turns, greedy, {args.max_new_tokens} new tokens; "
        f"medians per turn (restored / prompt tokens, time to the first token):"
    )
    for t in range(args.turns):
        line = []
        for mode in ("chat", "responses"):
            got = rows.get((t, mode), [])
            if got:
                line.append(
                    f"{mode} {statistics.median(r[1] for r in got):.0f} / "
                    f"{statistics.median(r[0] for r in got):.0f}, "
                    f"{statistics.median(r[2] for r in got) * 1000:.0f} ms (n={len(got)})"
                )
        print(f"turn {t + 1}: " + "; ".join(line))
    print(f"answers equal in both modes: {same} of {total}")


if __name__ == "__main__":
    main()
