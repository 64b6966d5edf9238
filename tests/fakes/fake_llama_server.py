#!/usr/bin/env python3
"""A stand-in for llama.cpp's `llama-server` in tests: the same command line, /health and /completion.

It "generates" prompt[-1]+1, +2, ... (capped by n_predict; token 2 stops, as an end-of-generation token would),
and reports fixed timings; with -md it also reports drafted and accepted counts (half the tokens accepted).
FAKE_LLAMA_SERVER_EXIT=1 makes it exit at once, as a server that cannot load its model does.
"""

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

if os.environ.get("FAKE_LLAMA_SERVER_EXIT"):
    print("error: failed to load model", flush=True)
    sys.exit(1)

ap = argparse.ArgumentParser()
for flag in ("-m", "-md", "-t", "-tb", "-c", "-np", "-fa", "--host", "--port", "--spec-type", "--spec-draft-n-max"):
    ap.add_argument(flag)
args = ap.parse_args()
print(f"fake llama-server: {vars(args)}", flush=True)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"status": "ok"}) if self.path == "/health" else self._send(404, {"error": "not found"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/completion" or not req.get("return_tokens"):
            return self._send(400, {"error": {"message": "bad request"}})
        tokens = []
        for i in range(req["n_predict"]):
            tokens.append((req["prompt"][-1] + 1 + i) % 50)
            if tokens[-1] == 2:
                break
        timings = {
            "prompt_n": len(req["prompt"]),
            "prompt_ms": 10.0,
            "predicted_n": len(tokens),
            "predicted_ms": 5.0 * len(tokens),
        }
        if args.md:
            timings.update(draft_n=4 * len(tokens), draft_n_accepted=len(tokens) // 2)
        if "json_schema" in req:  # echoed, so that tests see extra request fields arrive
            timings["json_schema"] = req["json_schema"]
        self._send(200, {"tokens": tokens, "content": "", "stop_type": "limit", "timings": timings})


HTTPServer((args.host, int(args.port)), Handler).serve_forever()
