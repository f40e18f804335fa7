"""A stand-in for vLLM's OpenAI-compatible server, for tests of quantlab's
client: the same routes and response shapes (``/health``, ``/metrics``,
``/v1/completions`` with ``prompt_logprobs`` and streaming) over a fixed toy
model: the next token after ``t`` is ``(t + 1) % V``, with log-probability
``log 0.5``, and the rest of the mass spread evenly.

``FAKE_VLLM_MODE``: ``ok``; ``exit`` (dies at start); ``die-on-request``
(answers ``/health``, then fails the first completion with 500, as a build
without a kernel does); ``coalesce`` (streams two tokens per chunk, as vLLM
does when a client reads slower than the engine steps). Its ``/metrics``
keeps vLLM's TTFT, per-request TPOT and inter-token histograms (sum and
count) as the engine times the tokens, one ``STEP_S`` apart. Started as ``python server.py --port P ...`` by
``tests/fake_vllm/python`` (the stand-in interpreter).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

V = 16
STEP_S = 0.01


def dist(t: int, k: int) -> dict[str, dict]:
    """Top ``k`` (all for -1) of the toy model's next-token distribution after ``t``."""
    rest = math.log(0.5 / (V - 1))
    probs = [(n, math.log(0.5) if n == (t + 1) % V else rest) for n in range(V)]
    probs.sort(key=lambda p: (-p[1], p[0]))
    return {str(n): {"logprob": lp, "rank": r + 1, "decoded_token": None}
            for r, (n, lp) in enumerate(probs) if k == -1 or r < k}


def histogram(name: str, total: float, count: int) -> str:
    return f"{name}_sum{{model_name=\"q\"}} {total}\n{name}_count{{model_name=\"q\"}} {count}\n"


class Handler(BaseHTTPRequestHandler):
    iterations = 0
    lock = threading.Lock()
    timed = {"time_to_first_token": [0.0, 0], "request_time_per_output_token": [0.0, 0],
             "inter_token_latency": [0.0, 0]}

    @classmethod
    def observe(cls, name: str, seconds: float, n: int = 1) -> None:
        with cls.lock:
            cls.timed[name][0] += seconds * n
            cls.timed[name][1] += n

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/health":
            self._send(200, "")
        elif self.path == "/metrics":
            text = f"vllm:iteration_tokens_total_count{{model_name=\"q\"}} {Handler.iterations}\n"
            text += "".join(histogram(f"vllm:{k}_seconds", s, n) for k, (s, n) in Handler.timed.items())
            self._send(200, text, "text/plain")
        else:
            self._send(404, "{}")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if os.environ.get("FAKE_VLLM_MODE") == "die-on-request":
            self._send(500, json.dumps({"error": "RuntimeError: Unsupported CPU attention configuration"}))
            os._exit(1)
        prompt, n = req["prompt"], req["max_tokens"]
        tokens = [(prompt[-1] + 1 + i) % V for i in range(n)]
        if not req.get("stream"):
            choice = {"token_ids": tokens, "prompt_token_ids": prompt}
            if (k := req.get("prompt_logprobs")) is not None:
                rows = [None]
                for i in range(1, len(prompt)):
                    row = dist(prompt[i - 1], k)
                    row.setdefault(str(prompt[i]), dist(prompt[i - 1], -1)[str(prompt[i])])
                    rows.append(row)
                choice["prompt_logprobs"] = rows
            Handler.iterations += n
            self._send(200, json.dumps({"choices": [choice]}))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        per_chunk = 2 if os.environ.get("FAKE_VLLM_MODE") == "coalesce" else 1
        for i in range(0, n, per_chunk):
            chunk = tokens[i:i + per_chunk]
            time.sleep(STEP_S * len(chunk))
            Handler.iterations += len(chunk)
            self.wfile.write(f"data: {json.dumps({'choices': [{'token_ids': chunk}]})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.observe("time_to_first_token", STEP_S)  # the engine's times, one step a token
        self.observe("inter_token_latency", STEP_S, n - 1)
        if n > 1:
            self.observe("request_time_per_output_token", STEP_S)


def main() -> None:
    if os.environ.get("FAKE_VLLM_MODE") == "exit":
        print("RuntimeError: no model here", flush=True)
        sys.exit(3)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("INFO CPU KV cache size: 4,096 tokens", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
