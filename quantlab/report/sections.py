"""Per-probe sections of the report: the KV cache's error by position and
the passkey table."""
from __future__ import annotations


def _tokens(n: str) -> int:
    """The inverse of :func:`quantlab.probes.kv_position.tokens_name`: ``1k`` -> 1024."""
    return int(n[:-1]) * 1024 if n.endswith("k") else int(n)


def _bucket_start(key: str) -> int:
    return _tokens(key.split("_")[-2])


def kv_position_series(runs) -> dict[str, list[tuple[float, float, float]]]:
    """Per point that ran the position probe: ``(bucket midpoint, KL, se)`` per bucket."""
    out = {}
    for r in runs:
        m = r.metrics
        if not r.done or "kvpos/windows" not in m:
            continue
        out[r.name] = [((_tokens(k.split("_")[-2]) + _tokens(k.split("_")[-1])) / 2, m[k],
                                 m.get(k + "_stderr", 0.0))
                                for k in m if k.startswith("kvpos/kl_") and not k.endswith("_stderr")]
    return out


def kv_position_table(runs) -> str:
    """Markdown: each point's KV-cache KL by position bucket (± se over
    windows) and the first bucket whose bound passed the tolerance; '' when
    no point ran the position probe."""
    timed = [r for r in runs if r.done and "kvpos/windows" in r.metrics]
    if not timed:
        return ""
    keys = sorted({k for r in timed for k in r.metrics if k.startswith("kvpos/kl_") and not k.endswith("_stderr")},
                  key=_bucket_start)
    head = ["point", *(k.removeprefix("kvpos/kl_").replace("_", "-") for k in keys), "first bucket over"]
    rows = [[r.name, *(f"{r.metrics[k]:.2e}±{r.metrics.get(k + '_stderr', float('nan')):.1e}"
                                if k in r.metrics else "-" for k in keys),
             r.tags.get("kvpos.first_over", "-")] for r in timed]
    lines = ["KV cache by position (KL against the uncached pass per bucket of positions, ± se over windows; "
             "the first bucket whose one-sided 95 % bound passes probe.kv_position.tolerance):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def passkey_table(runs) -> str:
    """Markdown: each point's passkey accuracy by prompt length with its
    95 % Wilson interval, the same engine's accuracy without a cache, and the
    key's NLL through the cache minus without it (± se over trials); ''
    when no point ran the passkey probe."""
    done = [r for r in runs if r.done and "passkey/trials" in r.metrics]
    if not done:
        return ""
    keys = sorted({k for r in done for k in r.metrics
                   if k.startswith("passkey/acc_") and k.removeprefix("passkey/acc_").rstrip("k").isdigit()},
                  key=lambda k: _tokens(k.removeprefix("passkey/acc_")))
    head = ["point", *(f"{k.removeprefix('passkey/acc_')} tokens" for k in keys), "without cache",
            "key NLL cached - uncached"]

    def cell(m, k):
        return f"{m[k]:.2f} [{m[k + '_lower']:.2f}, {m[k + '_upper']:.2f}]" if k in m else "-"

    rows = [[r.name, *(cell(r.metrics, k) for k in keys),
             f"{r.metrics['passkey/acc_nocache']:.2f}" if "passkey/acc_nocache" in r.metrics else "-",
             f"{r.metrics['passkey/dnll']:+.3f}±{r.metrics.get('passkey/dnll_stderr', float('nan')):.3f}"
             if "passkey/dnll" in r.metrics else "-"] for r in done]
    lines = ["Passkey retrieval (greedy decoding finds the key, by prompt length over every depth, 95 % Wilson "
             "interval; the same engine without a cache; the key's NLL in nats through the cache minus without "
             "it, ± se over trials; acc/passkey is a decision metric: --metric acc/passkey):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
