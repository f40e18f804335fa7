"""The engine contract: one decode loop, probes that talk to any engine, a new
engine in one file, thread settings undone after a point, and fidelity data
that is only read when the probe runs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from quantlab import models
from quantlab.config import ModelConfig
from quantlab.targets.cpu import CPUTargetConfig
from quantlab.decode import Clock, decode_loop
from quantlab.engines.pytorch import TorchEngine
from tests.conftest import compose_cfg
from tests.fake_engine import PREFILL_MS, STEP_MS, FakeTargetConfig


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()


def test_decode_loop_positions_and_teacher_forcing():
    """``forward`` sees each input at the right position; ``choose`` may feed known
    tokens several at a time; ``record`` sees every output."""
    seen, recorded = [], []

    def forward(ids, start):
        seen.append((ids.tolist(), start))
        return torch.nn.functional.one_hot((ids[:, -1:] + 1) % 16, 16).float()  # next = last + 1

    out = decode_loop(forward, torch.tensor([[1, 2, 3]]), 4, Clock(), record=recorded.append)
    assert [c.tolist() for c in out.chosen] == [[[4]], [[5]], [[6]], [[7]]]
    assert [s for _, s in seen] == [0, 3, 4, 5] and len(out.step_ms) == 3 and len(recorded) == 4
    seen.clear()
    known = torch.tensor([[9, 8, 7, 6, 5]])
    decode_loop(forward, known[:, :1], 3, Clock(), choose=lambda _l, i: known[:, 1 + 2 * i:3 + 2 * i])
    assert seen == [([[9]], 0), ([[8, 7]], 1), ([[6, 5]], 3)]


def test_torch_engine_logits_and_decode_match_the_model(tiny):
    model, _ = tiny
    eng = TorchEngine(model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(eng.logits(ids), model(input_ids=ids).logits.float())
        ref = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)[:, 12:]
    out = eng.decode(ids, 5)
    assert torch.equal(torch.cat(out.chosen, dim=1), ref) and out.kv_bytes > 0
    assert eng.cannot("cache") == "" and "compiled" in TorchEngine(model, compiled=True).cannot("stages")
    with pytest.raises(ValueError, match="unknown capability 'warp'; valid: cache, stages"):
        eng.cannot("warp")


@settings(max_examples=12, deadline=None)
@given(first=st.integers(0, 10), batch=st.integers(1, 3))
def test_scoring_from_a_later_position_is_the_tail_of_full_scoring(tiny, first, batch):
    """``token_logprobs(ids, first)`` is ``token_logprobs(ids)`` from ``first``
    on, on the torch engine (whose head then runs on those positions only) and
    on an engine that inherits the default (every logit, then trimmed)."""
    from tests.fake_engine import FakeEngine

    model, _ = tiny
    ids = torch.randint(0, 256, (batch, 12), generator=torch.Generator().manual_seed(first))
    full_lp, full_top = TorchEngine(model).token_logprobs(ids)
    for eng in (TorchEngine(model), FakeEngine(model)):
        lp, top = eng.token_logprobs(ids, first)
        assert lp.shape == (batch, 11 - first)
        torch.testing.assert_close(lp, full_lp[:, first:], rtol=1e-5, atol=1e-5)
        assert torch.equal(top, full_top[:, first:])


def test_the_head_runs_on_the_scored_positions_only(tiny):
    model, _ = tiny
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[:-1].numel()))
    try:
        TorchEngine(model).token_logprobs(torch.zeros(2, 12, dtype=torch.long), 8)
    finally:
        hook.remove()
    assert rows == [2 * 3]
    with pytest.raises(ValueError, match=r"first=11 must lie in \[0, 11\)"):
        TorchEngine(model).token_logprobs(torch.zeros(2, 12, dtype=torch.long), 11)


def test_a_new_engine_in_one_file_is_probed_and_logged(tmp_path):
    """tests/fake_engine.py: fake timings land in MLflow exactly, logits-based
    probes see the wrapped model (fp32 weights: KL 0 against the fp32 reference),
    and what the engine says it cannot do is tagged, not crashed."""
    from quantlab.pipeline import run_point

    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = compose_cfg(["model=tiny", "scheme/weights=fp32", "probe.latency.repeats=3", "probe.latency.warmup=1",
                       "probe.cache.enabled=true", "probe.cache.corpus=builtin", "probe.cache.prefix_tokens=32",
                       "probe.cache.continuation_tokens=16",
                       f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/a"])
    cfg.target = FakeTargetConfig()
    res = run_point(cfg)
    assert res.outcome == "finished" and res.name == "fp32@fake", res.reason
    run = MlflowClient(uri).get_run(res.run_id)
    m, tags = run.data.metrics, run.data.tags
    steps = cfg.probe.latency.new_tokens - 1
    assert m["lat/tpot_ms_p50"] == m["lat/tpot_ms_p99"] == STEP_MS
    assert m["lat/tpot_ms_count"] == 3 * steps and m["lat/prefill_ms_p50"] == PREFILL_MS
    assert m["lat/ttft_ms_p50"] >= PREFILL_MS
    assert m["tput/decode_tok_s"] == pytest.approx(1000 / STEP_MS)
    assert m["mem/kv_mb"] == pytest.approx(1234 / 2**20)
    assert m["compile/warmup_s"] == 0.125 and m["compile/fake_engine"] == 1.0
    assert m["fid/kl_mean"] == 0.0 and m["fid/top1_agree"] == 1.0
    for probe in ("cache", "stages"):
        assert tags[f"probe.{probe}.skipped"] == "the fake engine does not offer it"
    assert tags["energy.reason"] == "the fake engine does not offer it"
    assert not any(k.startswith(("bw/", "stage/", "kvfid/")) for k in m)


def test_cpu_threads_are_restored_after_a_point_which_asks_its_target_once(tmp_path, monkeypatch):
    from quantlab.pipeline import run_point
    from quantlab.targets.base import LocalTarget

    asked = []
    supports = LocalTarget.supports
    monkeypatch.setattr(LocalTarget, "supports", lambda self, w, kv: asked.append(1) or supports(self, w, kv))
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    cfg = compose_cfg(["model=tiny", "probe=smoke", f"target.threads={want}",
                       f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/a"])
    res = run_point(cfg)
    assert res.outcome == "finished", res.reason
    assert MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(res.run_id).data.tags["threads"] == str(want)
    assert torch.get_num_threads() == before
    assert len(asked) == 1  # whether the target runs the scheme: asked once a point, not again to build it


def test_fidelity_corpus_is_read_only_when_fidelity_runs(tmp_path):
    """A missing WikiText file used to fail the whole point, even with fidelity off."""
    from quantlab.pipeline import run_point

    common = ["model=tiny", "probe=smoke", "probe.fidelity.corpus=wikitext2", f"data_dir={tmp_path}/nodata",
              f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/a"]
    off = run_point(compose_cfg([*common, "probe.fidelity.enabled=false"]))
    assert off.outcome == "finished", off.reason
    on = run_point(compose_cfg([*common, "probe.fidelity.enabled=true", "force=true"]))
    assert on.outcome == "finished", on.reason
    run = MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(on.run_id)
    assert "wiki.test.raw" in run.data.tags["probe.fidelity.skipped"]
    assert "fid/kl_mean" not in run.data.metrics and "lat/tpot_ms_p50" in run.data.metrics


def test_cpu_target_session_is_a_context(tmp_path):
    from quantlab import targets

    before = torch.get_num_threads()
    with targets.get(CPUTargetConfig(threads=1)).session():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
