"""Probe numerics against independent computations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantlab import models
from quantlab.config import ModelConfig
from quantlab.probes.configs import LatencyProbeConfig
from quantlab.decode import Clock
from quantlab.engines.pytorch import TorchEngine
from quantlab import corpus
from quantlab.probes import fidelity, latency, size
from quantlab.stats import summarize


def _percentile_ref(xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, written out by hand."""
    s = sorted(xs)
    rank = p / 100 * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


@given(st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_match_hand_computation(xs):
    out = summarize("x", xs)
    for p in (50, 90, 99):
        assert out[f"x_p{p}"] == pytest.approx(_percentile_ref(xs, p), rel=1e-9, abs=1e-9)
    assert out["x_count"] == len(xs)
    assert out["x_mean"] == pytest.approx(sum(xs) / len(xs), rel=1e-9, abs=1e-9)


def test_percentiles_known_values():
    out = summarize("t", list(range(1, 101)))  # 1..100
    assert out["t_p50"] == 50.5 and out["t_p90"] == pytest.approx(90.1) and out["t_p99"] == pytest.approx(99.01)


def test_summarize_rejects_empty():
    with pytest.raises(ValueError, match="no samples"):
        summarize("x", [])


def test_kl_zero_for_identical_and_matches_hand_formula():
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(7, 11), -1)
    same = fidelity.compare(ref, ref.clone())
    assert same["fid/kl_mean"] == 0.0 and same["fid/top1_agree"] == 1.0
    q = torch.log_softmax(torch.randn(7, 11), -1)
    out = fidelity.compare(ref, q)
    p = ref.double().exp().numpy()
    hand = [sum(p[t, v] * (math.log(p[t, v]) - q[t, v].item()) for v in range(11)) for t in range(7)]
    assert out["fid/kl_mean"] == pytest.approx(np.mean(hand), rel=1e-6)
    assert out["fid/kl_max"] == pytest.approx(max(hand), rel=1e-6)
    agree = np.mean([ref[t].argmax() == q[t].argmax() for t in range(7)])
    assert out["fid/top1_agree"] == pytest.approx(agree)


def test_reference_cached_on_disk(tmp_path):
    ids = torch.arange(10)[None]
    calls = []

    def build():
        calls.append(1)
        return TorchEngine(models.tiny_model(ModelConfig(name="tiny", source="tiny")))

    a = fidelity.reference({"m": 1}, ids, str(tmp_path), build)
    b = fidelity.reference({"m": 1}, ids, str(tmp_path), build)
    assert len(calls) == 1 and torch.equal(a, b)
    fidelity.reference({"m": 2}, ids, str(tmp_path), build)
    assert len(calls) == 2  # another key, another entry


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model(ModelConfig(name="tiny", source="tiny")), models.byte_tokenizer()


def test_latency_probe_counts_and_ordering(tiny):
    model, tok = tiny
    cfg = LatencyProbeConfig(batch_size=2, prompt_tokens=24, new_tokens=5, warmup=1, repeats=3)
    metrics, raw = latency.measure(TorchEngine(model), tok, corpus.prompt_text(tok, 24), cfg)
    runs = [r for _, _, r in raw]
    assert len(runs) == 3 and all(len(r.step_ms) == 4 for r in runs)
    assert all(r.ttft_ms >= r.prefill_ms > 0 and min(r.step_ms) > 0 for r in runs)
    assert metrics["lat/tpot_ms_count"] == 12
    assert metrics["tput/decode_tok_s"] == pytest.approx(2000.0 / metrics["lat/tpot_ms_mean"])
    assert metrics["mem/peak_rss_mb"] > 0


def test_latency_probe_decodes_like_generate(tiny):
    """The timed loop is a real greedy decode: same tokens as model.generate."""
    model, tok = tiny
    cfg = LatencyProbeConfig(batch_size=1, prompt_tokens=16, new_tokens=6)
    ids = tok(corpus.prompt_text(tok, 16), return_tensors="pt", add_special_tokens=False)["input_ids"][:, :16]
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 16:]
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model
            self.config = model.config

        def forward(self, **kw):
            out = self.inner(**kw)
            seen.append(out.logits[:, -1].argmax(-1).item())
            return out

    latency.run_request(TorchEngine(Spy()), tok, corpus.prompt_text(tok, 16), cfg, Clock())
    assert seen == ref.tolist()


def test_prompt_too_short_is_an_error(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="probe needs 50"):
        latency.measure(TorchEngine(model), tok, "short", LatencyProbeConfig(prompt_tokens=50))


def test_weight_bytes_by_dtype(tiny):
    model, _ = tiny
    n = size.count_params(model)
    fp32 = size.weight_stats(model, n)
    assert fp32["size/params"] == n and fp32["size/bits_per_weight"] == pytest.approx(32.0, rel=1e-3)
    half = size.weight_stats(models.tiny_model(ModelConfig(name="t", source="tiny"), torch.bfloat16), n)
    assert half["size/bits_per_weight"] == pytest.approx(16.0, rel=1e-3)


@settings(max_examples=50)
@given(st.text(max_size=200))
def test_byte_tokenizer_round_trips_any_text(s):
    tok = models.byte_tokenizer()
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s


def test_token_ids_fixed_length_and_deterministic():
    tok = models.byte_tokenizer()
    a = corpus.token_ids(tok, "builtin", 5000)
    assert a.shape == (1, 5000) and torch.equal(a, corpus.token_ids(tok, "builtin", 5000))


class _Scripted:
    """An engine whose greedy decode returns a fixed token list."""

    def __init__(self, tokens):
        self.tokens = tokens

    def decode(self, prompt, n_new):
        from quantlab.decode import Decoded

        return Decoded(prefill_ms=1.0, chosen=[torch.tensor([[t]]) for t in self.tokens[:n_new]])


@pytest.mark.parametrize("a,b,same", [([1, 2, 3, 4], [1, 2, 3, 4], 4), ([1, 2, 3, 4], [1, 2, 9, 4], 2),
                                      ([5, 2, 3, 4], [1, 2, 3, 4], 0)])
def test_greedy_parity_is_the_common_prefix(a, b, same):
    out = fidelity.greedy_parity(_Scripted(a), _Scripted(b), torch.tensor([[0, 1]]), 4)
    assert out == {"parity/greedy_match_tokens": same, "parity/greedy_tokens": 4}


def test_parity_statistics_are_fidelity_renamed():
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(8, 10, generator=g), -1)
    fid = fidelity.compare(ref, ref, torch.arange(7))
    par = fidelity.as_parity(fid)
    assert par["parity/kl_mean"] == 0.0 and par["parity/top1_agree"] == 1.0 and par["parity/ln_ppl_ratio"] == 0.0
    assert set(par) == {"parity/" + k[4:] for k in fid}
