"""The report of a fixed store, byte for byte: a sweep of four points with
per-window perplexity (articles included), lm-eval documents, fidelity,
latency, sizes and a re-timing, written through the tracker as a sweep
writes it. Any change to what the report says shows here as a diff of
``tests/golden/report.md``; one that is meant is accepted with
``QUANTLAB_UPDATE_GOLDEN=1 python -m pytest tests/test_report_golden.py``
and reviewed in the commit."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from quantlab import point, report, retime, tracking
from quantlab.tracking_config import TrackingConfig

GOLDEN = Path(__file__).parent / "golden" / "report.md"
WINDOWS, TOKENS, DOCS = 64, 31, 200
# name -> (bits, size MiB, TPOT ms, shift of the NLL per token, top-1 agreement, documents flipped to wrong)
POINTS = {"fp32": (32, 512.0, 40.0, 0.0, 1.0, 0), "bf16": (16, 256.0, 21.0, 0.0005, 0.995, 1),
          "int8": (8, 128.0, 14.0, 0.003, 0.97, 4), "int4-g64": (4.5, 72.0, 12.5, 0.06, 0.85, 30)}
PPL = "ppl_token_wikitext2_w32_rand64"


def _store(tmp_path: Path) -> tuple[tracking.Tracker, str, dict[str, str]]:
    t = tracking.connect(TrackingConfig(uri=f"sqlite:///{tmp_path}/m.db", artifact_root=str(tmp_path / "art")))
    d = point.DECLARED_TAGS
    parent = t.start("sweep:golden", {point.SWEEP_TAG: "golden", point.ROLE_TAG: point.ROLE_SWEEP,
                                      point.EVAL_SEED_TAG: "12345", point.EVAL_SEED_FROM_TAG: "drawn",
                                      d["metric"]: "auto", d["budgets"]: "0.01,0.05", d["alpha"]: "0.05",
                                      d["latency_share"]: "0.5", d["retime_rounds"]: "12", d["retime_points"]: "4",
                                      d["tie_break"]: "size"})
    rng = np.random.default_rng(0)
    articles = sorted(rng.integers(0, 30, WINDOWS).tolist())
    base_nll = rng.gamma(2.0, 1.5, (WINDOWS, TOKENS))
    article_shift = rng.normal(0, 0.01, 30)
    truth = rng.random(DOCS) < 0.6
    ids = {}
    for name, (bits, mib, tpot, shift, top1, flipped) in POINTS.items():
        run = t.start(f"{name}@cpu", {point.SWEEP_TAG: "golden", point.SCHEME_TAG: name, "scheme.weights": name,
                                      "scheme.kv": "none", "target": "cpu", "target.variant": "cpu",
                                      point.EMULATED_TAG: "false", "model": "tiny"}, parent=parent.id)
        scale = 0.0 if shift == 0 else 1.0
        nll = base_nll + shift + scale * (rng.normal(0, 0.02, base_nll.shape) + article_shift[articles][:, None] * shift)
        correct = truth.copy()
        correct[rng.choice(DOCS, flipped, replace=False)] = False
        means = nll.mean(axis=1)
        run.log_metrics({PPL: float(np.exp(nll.mean())), f"{PPL}_ln_stderr": float(means.std(ddof=1) / 8),
                         f"{PPL}_windows": WINDOWS, f"{PPL}_articles": len(set(articles)),
                         "acc/lambada_openai_local": float(correct.mean()),
                         "acc/lambada_openai_local_stderr": float(correct.std(ddof=1) / np.sqrt(DOCS)),
                         "fid/top1_agree": top1, "fid/kl_mean": (1 - top1) / 4, "lat/tpot_ms_p50": tpot,
                         "lat/tpot_ms_p99": tpot * 1.2, "lat/ttft_ms_p50": tpot * 3, "size/weight_mb": mib,
                         "size/bits_per_weight": bits, "time/load_s": 1.0, "time/quantize_s": 2.0 * (bits < 16)})
        run.log_text(json.dumps({PPL: [round(float(x), 5) for x in nll.ravel()], f"articles/{PPL}": articles,
                                 "acc/lambada_openai_local": correct.astype(float).tolist(),
                                 "doc_ids/lambada_openai_local": list(range(DOCS))}), tracking.ITEMS_ARTIFACT)
        run.end("finished")
        ids[run.id] = name
    table = [tuple(POINTS[n][2] * (1 + 0.01 * ((r * 7 + j) % 5)) for j, n in enumerate(("bf16", "int8")))
             for r in range(12)]
    parent.log_text(retime.Retimed(("bf16@cpu", "int8@cpu"), tuple(table)).to_json(), retime.ARTIFACT)
    parent.set_tags({point.BASELINE_TAG: "fp32@cpu"})
    return t, parent.id, {**ids, parent.id: "PARENT"}


def test_the_report_of_a_fixed_store_is_unchanged(tmp_path):
    t, parent, ids = _store(tmp_path)
    out = tmp_path / "report"
    text = report.build(t, parent, out_dir=out, log_to_run=False)
    for run_id, name in ids.items():
        text = text.replace(run_id, f"<{name}>")
    text = text.replace(str(out), "<out>")
    if os.environ.get("QUANTLAB_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_a_sweeps_items_are_read_once_by_the_retiming_and_the_report(tmp_path, monkeypatch):
    """After a sweep the re-timing reads its points' items (to find the
    candidates) and so does the report: one download of items.json per point,
    not two."""
    t, parent, ids = _store(tmp_path)
    reads = []
    monkeypatch.setattr(t.client, "download_artifacts", _counting(t.client.download_artifacts, reads))
    report.sweep_data(t, parent)
    report.build(t, parent, out_dir=tmp_path / "report", log_to_run=False)
    items = [r for r in reads if r[1] == "items.json"]
    assert items and len(items) == len({r[0] for r in items}) == len(ids) - 1, items


def _counting(download, reads):
    def counted(run_id, name, into):
        reads.append((run_id, name))
        return download(run_id, name, into)
    return counted
