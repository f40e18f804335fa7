"""llama.cpp's own scheduler under load: llama-server's parallel slots serve a
point's GGUF, tokens equal the binding's greedy decode, and requests share
decode steps. The server binary is built once from the llama.cpp that
llama-cpp-python vendors (scripts/build_llama_tools.sh, cached by version)."""
from __future__ import annotations

import pytest
import torch

from quantlab import models
from quantlab.export import gguf as gguf_export
from quantlab.config import ModelConfig, TinyModelConfig
from quantlab.probes.configs import LoadProbeConfig
from quantlab.errors import UserError
from quantlab.probes import load
from quantlab.serving import llama_server, policies
from quantlab.serving.requests import Limits

pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'quantlab[llamacpp]')")
from quantlab.engines.llamacpp import LlamaCppEngine  # noqa: E402


@pytest.fixture(scope="session")
def server_bin(llama_tools):
    """An existing llama-server, else the one of llama.cpp's tools built here."""
    return llama_server.binary() or str(llama_tools / "llama-server")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # head_dim 32, as llama.cpp's quantized caches need; float weights (F32 GGUF)
    model = models.tiny_model(ModelConfig(name="tiny", source="tiny",
                                          tiny=TinyModelConfig(hidden_size=128, intermediate_size=256)))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    gguf_export.write(model, models.byte_tokenizer(), path)
    eng = LlamaCppEngine(path, "F16", model.config.vocab_size, n_ctx=256, threads=2)
    yield eng
    eng.close()


@pytest.mark.slow
@pytest.mark.network
def test_llama_server_slots_serve_concurrent_requests_with_the_bindings_tokens(server_bin, engine, monkeypatch):
    monkeypatch.setenv("QUANTLAB_LLAMA_SERVER", server_bin)
    assert policies.cannot("continuous", engine) == ""
    prompts = [torch.arange(4 + 3 * i) + 10 * i + 3 for i in range(4)]
    policy = engine.scheduler(4, 48)
    try:
        reqs, stopped = load.run_rate(policy, prompts, 12, 1000.0, 0.008, "constant",
                                      Limits(max_backlog=50, drain_s=60), 0)
    finally:
        policy.close()
    assert policy.server.proc.poll() is not None  # closed
    assert stopped == "" and len(reqs) == 8 and all(r.done and len(r.tokens) == 12 for r in reqs)
    assert all(r.sent_s <= r.start_s <= r.tokens_s[0] and r.tokens_s == sorted(r.tokens_s) for r in reqs)
    # parallel slots: requests ran beside each other and shared llama_decode calls
    assert max(r.batch for r in reqs) > 1
    assert 0 < policy.steps < sum(r.n_new for r in reqs)
    # every token the server streamed is the binding's greedy token at that position (the
    # byte tokenizer's tokens >= 128 are partial UTF-8 the server holds back: -1 here)
    known = 0
    for r in reqs[:4]:
        ref = torch.cat(engine.decode(r.prompt[None], 12).chosen, dim=1)[0].tolist()
        assert all(t in (-1, want) for t, want in zip(r.tokens, ref)), (r.tokens, ref)
        known += sum(t != -1 for t in r.tokens)
    assert known >= 30


def test_llamacpp_engine_without_a_server_says_how_to_get_one(engine, monkeypatch):
    monkeypatch.setenv("QUANTLAB_LLAMA_SERVER", "/nonexistent/llama-server")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    why = policies.cannot("continuous", engine)
    assert "QUANTLAB_LLAMA_SERVER" in why and "build_llama_tools.sh" in why
    assert "one sequence" in policies.cannot("dynamic", engine) and policies.cannot("passthrough", engine) == ""
    with pytest.raises(UserError, match="no llama-server: set QUANTLAB_LLAMA_SERVER"):
        policies.make_policy("continuous", engine, LoadProbeConfig())


def test_a_server_that_cannot_start_fails_with_its_last_lines(tmp_path, monkeypatch):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: model file is not a GGUF' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("QUANTLAB_LLAMA_SERVER", str(fake))
    with pytest.raises(RuntimeError, match=r"llama-server exited \(1\): error: model file is not a GGUF"):
        llama_server.LlamaServer(tmp_path / "none.gguf", 2, 64, 1, "F16", 32, True)
