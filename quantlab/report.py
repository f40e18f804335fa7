"""Tables of a sweep's points, read back from MLflow."""
from __future__ import annotations

from quantlab import tracking

# (header, metric or tag key, format)
COLUMNS = (
    ("point", "name", "{}"),
    ("outcome", "tag:" + tracking.OUTCOME_TAG, "{}"),
    ("emulated", "tag:emulated", "{}"),
    ("MB", "size/weight_mb", "{:.1f}"),
    ("bits/w", "size/bits_per_weight", "{:.2f}"),
    ("KL mean", "fid/kl_mean", "{:.2e}"),
    ("top1", "fid/top1_agree", "{:.3f}"),
    ("TTFT p50 ms", "lat/ttft_ms_p50", "{:.1f}"),
    ("TPOT p50 ms", "lat/tpot_ms_p50", "{:.2f}"),
    ("TPOT p99 ms", "lat/tpot_ms_p99", "{:.2f}"),
    ("decode tok/s", "tput/decode_tok_s", "{:.1f}"),
    ("peak RSS MB", "mem/peak_rss_mb", "{:.0f}"),
)


def _cell(run, key: str, fmt: str, reused: bool) -> str:
    if key == "name":
        return run.info.run_name
    if key == "tag:" + tracking.OUTCOME_TAG and reused:
        return "reused"
    if key.startswith("tag:"):
        return run.data.tags.get(key[4:], "-")
    value = run.data.metrics.get(key)
    return "-" if value is None else fmt.format(value)


def table(runs, reused: set[str] = frozenset()) -> str:
    """Markdown table, one row per run; missing values are ``-``, never 0.
    Runs in ``reused`` were finished by an earlier sweep and shown as such."""
    extra = sorted({k for r in runs for k in r.data.metrics
                    if k.startswith(("acc/", "acc_norm/", "ppl_token_wikitext2_w"))
                    and not k.endswith("_windows")})
    columns = [*COLUMNS, *((k, k, "{:.4g}") for k in extra)]
    rows = [[h for h, _, _ in columns]]
    rows += [[_cell(r, k, f, r.info.run_id in reused) for _, k, f in columns] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    reasons = [f"- {r.info.run_name}: {r.data.tags[tracking.REASON_TAG]}" for r in runs
               if tracking.REASON_TAG in r.data.tags]
    if reasons:
        lines += ["", "Skipped or failed:", *reasons]
    if any(r.data.tags.get("emulated") == "true" for r in runs):
        lines += ["", "emulated=true: no real low-precision kernel on this target; "
                  "latency is NOT that of the scheme (numerics and size are)."]
    return "\n".join(lines)


HIGHER_IS_BETTER = ("acc/", "acc_norm/", "exact_match/")
LOWER_IS_BETTER = ("ppl_token_wikitext2_w", "perplexity/", "word_perplexity/", "byte_perplexity/",
                   "bits_per_byte/")


def baseline_run(runs, choice: str = "auto"):
    """The run others are compared to: ``auto`` picks the finished point with the
    most bits per weight (the highest precision); otherwise the point whose
    scheme tag equals ``choice`` (e.g. ``bf16``). None if there is none."""
    done = [r for r in runs if r.data.tags.get(tracking.OUTCOME_TAG) == "finished"]
    if choice != "auto":
        return next((r for r in done if r.data.tags.get("scheme") == choice), None)
    with_bits = [r for r in done if "size/bits_per_weight" in r.data.metrics]
    return max(with_bits, key=lambda r: r.data.metrics["size/bits_per_weight"], default=None)


def recovery(metrics: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``recovery/<metric>``: score / baseline score, oriented so that 1.0 means
    fully recovered and < 1 means worse (perplexities are inverted), as in
    llm-compressor's recovery gate (>= 0.95 to ship)."""
    out = {}
    for key, value in metrics.items():
        b = base.get(key)
        if b is None or key.endswith("_windows"):
            continue
        if key.startswith(HIGHER_IS_BETTER) and b > 0:
            out[f"recovery/{key}"] = value / b
        elif key.startswith(LOWER_IS_BETTER) and value > 0:
            out[f"recovery/{key}"] = b / value
    return out
