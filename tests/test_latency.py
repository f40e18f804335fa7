"""Latency probe details: grid, repetition rule, stage breakdown, roofline, energy."""
from __future__ import annotations

import types

import pytest
import torch

from quantlab import models
from quantlab.config import ModelConfig, TinyModelConfig
from quantlab.probes.configs import LatencyProbeConfig
from quantlab.engines.pytorch import TorchEngine
from quantlab import corpus
from quantlab.probes import energy, latency, roofline, stages


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()


def test_grid_cells_primary_first():
    cfg = LatencyProbeConfig(batch_size=1, prompt_tokens=64, grid_batch_sizes=[1, 4], grid_prompt_tokens=[32, 64])
    assert latency.cells(cfg) == [(1, 64), (1, 32), (4, 32), (4, 64)]
    assert latency.cells(LatencyProbeConfig(batch_size=2, prompt_tokens=8)) == [(2, 8)]


def test_grid_metrics_per_cell(tiny):
    model, tok = tiny
    cfg = LatencyProbeConfig(prompt_tokens=16, new_tokens=4, repeats=2, grid_batch_sizes=[1, 3])
    heard = []
    m, raw = latency.measure(TorchEngine(model), tok, corpus.prompt_text(tok, 16), cfg, progress=heard.append)
    assert {(b, p) for b, p, _ in raw} == {(1, 16), (3, 16)}
    assert [line.split(":")[0] for line in heard] == ["cell batch 1 prompt 16", "cell batch 3 prompt 16"]
    assert f"TPOT p50 {m['cell/b3_p16/tpot_ms_p50']:.1f} ms (2 requests)" in heard[1]
    assert m["cell/b3_p16/tpot_ms_p50"] > 0 and not any(k.startswith("cell/b1_p16/") for k in m)  # primary: lat/*
    assert m["cell/b3_p16/kv_mb"] == pytest.approx(3 * m["mem/kv_mb"])
    csv = latency.samples_csv(raw)
    assert csv.count(",tpot,") == len(raw) * 3 and csv.startswith("batch,prompt_tokens,request")


@pytest.mark.parametrize("repeats,min_seconds,max_repeats,expect", [
    (2, 0.35, 100, 4),   # the duration binds: 4 requests of 0.1 s reach 0.35 s
    (5, 0.35, 100, 5),   # the count binds
    (2, 60.0, 4, 4),     # the cap binds
    (2, 0.0, 100, 2),
])
def test_repeats_until_count_and_duration(tiny, monkeypatch, repeats, min_seconds, max_repeats, expect):
    """The rule on a fake clock: each request takes 0.1 s of it, so the count
    does not depend on how busy the host is (a real clock on a loaded CI host
    made 2 requests outlast 0.3 s)."""
    model, tok = tiny
    now = [0.0]

    def request(*args, **kwargs):
        now[0] += 0.1
        return latency.RequestTiming(tokenize_ms=0.0, prefill_ms=90.0, ttft_ms=90.0, step_ms=[10.0])

    monkeypatch.setattr(latency, "run_request", request)
    monkeypatch.setattr(latency, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    cfg = LatencyProbeConfig(prompt_tokens=8, new_tokens=1, repeats=repeats, min_seconds=min_seconds,
                             max_repeats=max_repeats, warmup=1)
    metrics, runs = latency.measure_cell(TorchEngine(model), tok, corpus.prompt_text(tok, 8), cfg, 1, 8)
    assert len(runs) == expect and metrics["lat/e2e_ms_p50"] == pytest.approx(100.0)


def test_tpot_range_is_the_least_and_greatest_requests_median_step(tiny, monkeypatch):
    """Each request's TPOT is the median of its decode steps; the range the
    report compares picks by spans the requests' (none from one request)."""
    model, tok = tiny
    steps = iter([[100.0, 100.0, 100.0], [10.0, 30.0, 12.0], [20.0, 21.0, 22.0], [9.0, 11.0, 50.0]])

    def request(*args, **kwargs):
        return latency.RequestTiming(tokenize_ms=0.0, prefill_ms=90.0, ttft_ms=90.0, step_ms=next(steps))

    monkeypatch.setattr(latency, "run_request", request)
    cfg = LatencyProbeConfig(prompt_tokens=8, new_tokens=3, repeats=3, min_seconds=0.0, warmup=1)
    metrics, _ = latency.measure_cell(TorchEngine(model), tok, corpus.prompt_text(tok, 8), cfg, 1, 8)
    assert (metrics["lat/tpot_ms_req_lo"], metrics["lat/tpot_ms_req_hi"]) == (11.0, 21.0)  # warm-up not counted
    steps = iter([[10.0], [5.0]])
    metrics, _ = latency.measure_cell(TorchEngine(model), tok, corpus.prompt_text(tok, 8),
                                      LatencyProbeConfig(prompt_tokens=8, new_tokens=1, repeats=1, min_seconds=0.0,
                                                         warmup=1), 1, 8)
    assert "lat/tpot_ms_req_lo" not in metrics


def test_repeats_on_the_real_clock(tiny):
    """On the real engine: at least ``repeats``, and either ``min_seconds`` reached or the cap."""
    model, tok = tiny
    cfg = LatencyProbeConfig(prompt_tokens=8, new_tokens=2, repeats=2, min_seconds=0.3, max_repeats=50, warmup=0)
    _, runs = latency.measure_cell(TorchEngine(model), tok, corpus.prompt_text(tok, 8), cfg, 1, 8)
    assert len(runs) >= 2 and (len(runs) == 50 or sum(r.e2e_ms for r in runs) >= 0.5 * 300)


def test_stage_times_add_up_to_the_step():
    """On a model big enough that its layers, not Python, dominate a step."""
    model = models.tiny_model(ModelConfig(name="t", source="tiny", tiny=TinyModelConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8)))
    tok = models.byte_tokenizer()
    samples, totals = stages.measure(TorchEngine(model), tok, corpus.prompt_text(tok, 16), 16, steps=8, requests=2)
    assert len(totals) == 16 and all(len(samples[k]) == 16 for k in ("embedding", "final_norm", "lm_head"))
    layers = [k for k in samples if k.startswith("layer.")]
    assert len(layers) == model.config.num_hidden_layers
    parts = sum(sum(samples[k]) for k in ("embedding", "rotary", "final_norm", "lm_head", *layers))
    # the modules account for most of the step; the rest (masks, cache bookkeeping,
    # Python between modules) measured 11 % on a 2-core Xeon, under 10 % on an EPYC
    assert 0.75 * sum(totals) < parts <= sum(totals)
    csv, metrics = stages.table(samples, totals)
    assert "decoder_layers_total" in csv and "stage/lm_head_sample_ms_p99" in metrics
    between = [line for line in csv.splitlines() if line.startswith("between_stages,")][0].split(",")
    assert float(between[3]) == pytest.approx((sum(totals) - parts) / len(totals), rel=1e-3)


def test_bandwidth_is_bytes_times_rate():
    u = roofline.utilisation(bytes_per_step=2e8, step_ms=10.0, peak_bytes_per_s=4e10)
    assert u["bw/achieved_gb_s"] == pytest.approx(20.0) and u["bw/util"] == pytest.approx(0.5)


def test_host_bandwidth_cached(tmp_path, monkeypatch):
    from quantlab import contention

    monkeypatch.setattr(contention, "foreign_cores", lambda a, b: 0.0)  # measured on an idle host
    calls = []
    monkeypatch.setattr(roofline, "measure_read_bandwidth", lambda d: calls.append(d) or 1.5e10)
    assert roofline.host_bandwidth(str(tmp_path), torch.device("cpu")) == 1.5e10
    assert roofline.host_bandwidth(str(tmp_path), torch.device("cpu")) == 1.5e10
    assert len(calls) == 1


def test_host_bandwidth_measured_beside_other_work_is_not_kept(tmp_path, monkeypatch):
    """A contended measurement understates the host: used once, measured again next time."""
    from quantlab import contention

    values = iter([1.0e10, 1.6e10, 9.9e10])
    monkeypatch.setattr(roofline, "measure_read_bandwidth", lambda d: next(values))
    monkeypatch.setattr(contention, "foreign_cores", lambda a, b: 1.0)
    assert roofline.host_bandwidth(str(tmp_path), torch.device("cpu")) == 1.0e10
    monkeypatch.setattr(contention, "foreign_cores", lambda a, b: 0.0)
    assert roofline.host_bandwidth(str(tmp_path), torch.device("cpu")) == 1.6e10  # measured again, idle: kept
    assert roofline.host_bandwidth(str(tmp_path), torch.device("cpu")) == 1.6e10


def test_a_figure_cached_by_an_older_method_is_measured_again(tmp_path, monkeypatch):
    """Figures cached before the huge-page buffer (no ``method``) understate
    the host by 15-20 %: a point measures again and keeps the new figure."""
    import json
    import socket

    from quantlab import contention

    monkeypatch.setattr(contention, "foreign_cores", lambda a, b: 0.0)
    old = tmp_path / "bandwidth" / f"{socket.gethostname()}-cpu.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"bytes_per_s": 2.96e10, "measured": "2026-12-05T06:26:21"}))
    monkeypatch.setattr(roofline, "measure_read_bandwidth", lambda d: 3.5e10)
    assert roofline.host_bandwidth(str(tmp_path), torch.device("cpu")) == 3.5e10
    assert json.loads(old.read_text())["method"] == roofline.METHOD


def test_measured_bandwidth_is_plausible():
    bw = roofline.measure_read_bandwidth(torch.device("cpu"), mbytes=64, repeats=2)
    assert 1e9 < bw < 1e12


def test_energy_absent_with_reason_without_counter(monkeypatch, tmp_path):
    monkeypatch.setattr(energy, "RAPL", tmp_path / "no-powercap")
    counter, why = energy.open_counter(torch.device("cpu"))
    assert counter is None and "no RAPL powercap zone" in why


def test_rapl_counter_reads_and_wraps(monkeypatch, tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "energy_uj").write_text("5000000\n")
    (zone / "max_energy_range_uj").write_text("10000000\n")
    monkeypatch.setattr(energy, "RAPL", tmp_path)
    counter, why = energy.open_counter(torch.device("cpu"))
    assert why == "" and counter.read() == 5.0
    assert counter.delta(9.0, 1.0) == pytest.approx(2.0)  # wrapped at 10 J


def test_point_logs_energy_reason_not_zero(tmp_path):
    from mlflow.tracking import MlflowClient

    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["model=tiny", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                       f"tracking.artifact_root={tmp_path}/a", "probe.latency.repeats=1"])
    res = run_point(cfg)
    run = MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(res.run_id)
    has_counter = energy.open_counter(torch.device("cpu"))[0] is not None
    assert ("energy/joules" in run.data.metrics) == has_counter
    if not has_counter:
        assert run.data.tags["energy.reason"]
    m = run.data.metrics
    assert m["bw/achieved_gb_s"] > 0 and 0 < m["bw/util"] and m["sys/load1"] >= 0 and m["sys/foreign_cpu_cores"] >= 0
    assert "stage/decoder_layers_total_ms_p50" in m


def test_cell_prompt_is_cut_to_the_cell():
    """TTFT includes tokenizing the cell's own prompt, not the longest cell's."""
    tok = models.byte_tokenizer()
    long = corpus.prompt_text(tok, 512)
    short = latency.cell_prompt(tok, long, 32)
    assert long.startswith(short) and len(short) < len(long) / 8
    assert len(tok(short, add_special_tokens=False)["input_ids"]) >= 32


class _SecondsCounter:
    """An 'energy' counter that reads wall seconds: joules == seconds counted."""

    def read(self) -> float:
        import time

        return time.perf_counter()

    def delta(self, start: float, end: float) -> float:
        return end - start


def test_energy_counts_timed_requests_only(tiny):
    model, tok = tiny
    cfg = LatencyProbeConfig(prompt_tokens=16, new_tokens=8, repeats=2, warmup=6)
    m, runs = latency.measure_cell(TorchEngine(model), tok, corpus.prompt_text(tok, 16), cfg, 1, 16,
                                   _SecondsCounter())
    timed_s = sum(r.e2e_ms for r in runs) / 1000
    # warm-up (3x the timed requests) excluded: the counter saw about the timed time
    assert timed_s <= m["energy/joules"] < 1.5 * timed_s + 0.02
    assert m["energy/tok_per_j"] == pytest.approx(2 * 8 / m["energy/joules"])


def test_roofline_counts_only_the_embedding_rows_a_step_reads(tiny):
    from quantlab.probes import size

    model = models.tiny_model(ModelConfig(name="tiny", source="tiny"))
    emb = model.get_input_embeddings().weight
    table = emb.numel() * emb.element_size()
    assert size.embedding_unread_bytes(model, 1) == pytest.approx(table * (1 - 1 / emb.shape[0]))
    assert size.embedding_unread_bytes(model, 4) == pytest.approx(table * (1 - 4 / emb.shape[0]))
    model.get_output_embeddings().weight = emb  # tied: the LM head reads the whole table every step
    assert size.embedding_unread_bytes(model, 1) == 0.0


def test_stage_table_runs_at_the_cells_batch(tiny):
    model, tok = tiny
    engine = TorchEngine(model)
    shapes, decode = [], engine.decode
    engine.decode = lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or decode(ids, *a, **k)
    stages.measure(engine, tok, corpus.prompt_text(tok, 16), 16, steps=2, requests=1, batch=3)
    assert shapes == [(3, 16)]


def test_an_emulated_point_is_not_timed_when_told_to_skip(tmp_path):
    """``probe.latency.on_emulated=skip``: a point with no real kernel here
    (nvfp4-a16 on a CPU) logs its accuracy but no latency, and says why; a
    real point under the same setting is timed as ever."""
    from quantlab.pipeline import run_point
    from tests.conftest import compose_cfg, tracker

    uri = f"sqlite:///{tmp_path}/m.db"
    ran = {}
    for scheme in ("nvfp4-a16", "bf16"):
        cfg = compose_cfg(["model=tiny", "probe=smoke", f"scheme/weights={scheme}", "probe.latency.on_emulated=skip",
                           f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
        ran[scheme] = tracker(uri).get(run_point(cfg).run_id)
    emulated, real = ran["nvfp4-a16"], ran["bf16"]
    assert emulated.data.tags["emulated"] == "true" and emulated.data.tags["quantlab.outcome"] == "finished"
    assert emulated.data.tags["probe.latency.skipped"].startswith("emulated: no real kernel for this scheme here")
    assert not [k for k in emulated.data.metrics if k.startswith(("lat/", "stage/"))]
    assert "fid/kl_mean" in emulated.data.metrics
    assert real.data.tags["emulated"] == "false" and "probe.latency.skipped" not in real.data.tags
    assert real.data.metrics["lat/tpot_ms_p50"] > 0
