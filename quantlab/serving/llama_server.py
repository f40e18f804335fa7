"""llama.cpp's own scheduler under load: ``llama-server`` with parallel slots.

The llama-cpp-python binding decodes one sequence; llama.cpp serves many
through ``llama-server`` (one KV slot per sequence, continuous batching: every
step decodes one token of each running slot, a new request's prompt joins the
next step). :class:`ServerPolicy` starts that binary on the point's GGUF on
127.0.0.1 and sends each request as a streamed ``/completion`` of the prompt's
token ids (greedy: ``top_k=1``; ``ignore_eos``; no prompt cache, so every
request pays its prefill as under the other policies).

What is measured where: token times are when each streamed token reached
the client (what a user of the server sees); ``start_s`` (end of queueing) is
the first token's time less the prefill time the server reports; ``steps`` is
the server's ``llama_decode`` count (``/metrics``, ``n_decode_total``). The
server streams a token only once the text is whole UTF-8: a token it holds
back (part of a character) is timed when the one completing it arrives, and
its id is unknown to the client (``-1`` in ``Request.tokens``).

The binary: ``$QUANTLAB_LLAMA_SERVER`` or ``llama-server`` on ``PATH``
(``scripts/build_llama_tools.sh`` builds the one matching llama-cpp-python's
llama.cpp).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from quantlab.errors import UserError
from quantlab.serving.requests import Request
from quantlab.serving.streaming import StreamingPolicy

BUILD = "scripts/build_llama_tools.sh"


def binary() -> str | None:
    """The llama-server to run, or None."""
    path = os.environ.get("QUANTLAB_LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and os.access(path, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A running ``llama-server`` on the GGUF at ``path``, ``slots`` parallel
    sequences of ``ctx`` tokens each; ``close()`` stops it."""

    def __init__(self, path: Path, slots: int, ctx: int, threads: int, kv_type: str, n_batch: int,
                 extra_buffers: bool, ready_timeout_s: float = 120.0):
        exe = binary()
        if exe is None:
            raise UserError(f"no llama-server: set QUANTLAB_LLAMA_SERVER or put llama-server on PATH ({BUILD})")
        self.port, self.slots = _free_port(), slots
        cmd = [exe, "-m", str(path), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
               "-c", str(slots * ctx), "-t", str(threads), "-tb", str(threads), "-b", str(n_batch),
               "-ub", str(n_batch), "-ctk", kv_type.lower(), "-ctv", kv_type.lower(),
               "-fa", "off" if kv_type == "F16" else "on", "--cont-batching", "--metrics", "--no-webui",
               "--cache-ram", "0", "--no-warmup", "-ngl", "0"]
        if not extra_buffers:
            cmd.append("--no-repack")
        self.log = tempfile.NamedTemporaryFile(prefix="quantlab-llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = f"llama-server exited ({self.proc.returncode}): {self._tail()}"
                self.close()
                raise RuntimeError(why)
            try:
                if self._get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        why = f"llama-server not ready after {ready_timeout_s:g} s: {self._tail()}"
        self.close()
        raise RuntimeError(why)

    def _tail(self) -> str:
        return " | ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-3:])

    def _get(self, route: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", route)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def decode_calls(self) -> float:
        """The server's ``llama_decode`` count so far."""
        status, text = self._get("/metrics")
        for line in text.splitlines():
            if line.startswith("llamacpp:n_decode_total"):
                return float(line.split()[-1])
        raise RuntimeError(f"llama-server /metrics ({status}) has no n_decode_total")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class ServerPolicy(StreamingPolicy):
    """Requests through llama-server's slots (see the module docstring)."""

    def __init__(self, server: LlamaServer):
        super().__init__()
        self.server, self.slots = server, server.slots

    def stream_one(self, r: Request, t0: float, conns: dict) -> None:
        body = json.dumps({"prompt": r.prompt.tolist(), "n_predict": r.n_new, "stream": True, "top_k": 1,
                           "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": False,
                           "return_tokens": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=600)
        conns[r.rid] = conn
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - t0
            event = json.loads(line[6:])
            n = min(int(event.get("tokens_predicted", 0)), r.n_new)
            while len(r.tokens_s) < n:  # tokens held back reach the client with the one that follows
                r.tokens_s.append(now)
                r.tokens.append(-1)
            if event.get("tokens") and n:
                r.tokens[n - 1] = int(event["tokens"][-1])
            if event.get("stop"):
                prefill_s = event.get("timings", {}).get("prompt_ms", 0.0) / 1e3
                if r.tokens_s:
                    r.start_s = max(r.sent_s, r.tokens_s[0] - prefill_s)
                break

    def forwards(self) -> float:
        return self.server.decode_calls()

    def close(self) -> None:
        self.server.close()
