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
    rows = [[h for h, _, _ in COLUMNS]]
    rows += [[_cell(r, k, f, r.info.run_id in reused) for _, k, f in COLUMNS] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
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
