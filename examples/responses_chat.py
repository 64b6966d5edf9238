"""A multi-turn conversation through dflashkit's OpenAI-compatible server, with the official `openai` client.

Serves the default target (the embedded SmolLM2-135M-Instruct) with its shipped drafter in this process (the app of
`dflashkit serve`, uvicorn on a free loopback port) and holds the same conversation twice: through the Responses API,
where each turn sends only the new message and names the previous response (`previous_response_id`: the server keeps
the conversation, streamed here event by event), and through chat completions, where each turn sends the whole
conversation again. Both reuse the server's prompt prefix cache; each turn prints the answer, the prompt tokens and
how many of them the server restored from the cache instead of prefilling them.

    python examples/responses_chat.py [--turns 3] [--max-new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import openai
import torch
import uvicorn

from dflashkit import SpeculativeGenerator
from dflashkit.interop.llama_server import free_port
from dflashkit.server import create_app

MODEL = "smollm2"
TURNS = [
    "Name three uses of a paperclip.",
    "Which of them is the most surprising, and why?",
    "Summarise your answers so far in two sentences.",
]


def responses_turn(client: openai.OpenAI, user: str, previous: str | None, max_tokens: int):
    """One streamed Responses API turn: the final response (its text, usage and id)."""
    final = None
    for event in client.responses.create(
        model=MODEL, input=user, previous_response_id=previous, temperature=0, max_output_tokens=max_tokens, stream=True
    ):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, "the stream ended without a final response"
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=len(TURNS), help=f"user turns, at most {len(TURNS)}")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gen = SpeculativeGenerator.load()
    port = free_port()
    app = create_app(gen, model_id=MODEL, block_size="auto", lookup=True)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

        print("== Responses API: each turn names the previous response")
        previous = None
        for turn, user in enumerate(TURNS[: args.turns], 1):
            response = responses_turn(client, user, previous, args.max_new_tokens)
            previous = response.id
            usage = response.usage
            print(f"turn {turn}, user: {user}\nassistant: {response.output_text.strip()}")
            print(f"  {usage.input_tokens} prompt tokens, {usage.input_tokens_details.cached_tokens} restored")

        print("\n== Chat completions: each turn sends the whole conversation")
        messages: list[dict[str, str]] = []
        for turn, user in enumerate(TURNS[: args.turns], 1):
            messages.append({"role": "user", "content": user})
            completion = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=args.max_new_tokens, temperature=0
            )
            answer = completion.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            usage = completion.usage
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            print(f"turn {turn}, user: {user}\nassistant: {answer.strip()}")
            print(f"  {usage.prompt_tokens} prompt tokens, {cached} restored")
    finally:
        server.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
