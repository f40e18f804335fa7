"""The passkey probe's section of the report: retrieval by prompt length."""
from __future__ import annotations

from quantlab.metric_names import SectionView
from quantlab.probes.kv_position_report import tokens


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
                  key=lambda k: tokens(k.removeprefix("passkey/acc_")))
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


def section(view: SectionView) -> tuple[str, list[str]]:
    """The passkey table (:func:`passkey_table`); it writes no file."""
    return passkey_table(view.runs), []
