"""What the built-in probes' metric names mean to a decision: which way is
better, which are KL divergences, which are logged beside a metric rather
than being one. Light (no imports), so a launch can check a declared
decision metric before anything heavy loads; :mod:`quantlab.decision` reads
the same tables."""
from __future__ import annotations

HIGHER_IS_BETTER = ("acc/", "acc_norm/", "exact_match/")
LOWER_IS_BETTER = ("ppl_token_wikitext2_w", "perplexity/", "word_perplexity/", "byte_perplexity/",
                   "bits_per_byte/")
TOKEN_ITEMS = ("ppl_token_wikitext2_w",)  # per-item values are consecutive tokens, not documents
KL = ("fid/kl", "kvfid/kl")
# logged beside a metric, not metrics
AUXILIARY = ("_windows", "_documents", "_stderr", "_stderr_tokens", "_blocks", "_adaptive_cap", "_adaptive_chunk")
IDENTICAL = "fid/identical"  # 1.0: the point's log-probabilities equal the reference's on every position
# the fidelity and KV-cache probes' metrics a decision can bound (their standard errors are logged)
FIDELITY = ("fid/kl_mean", "fid/top1_agree", "fid/kl_topk_lb_mean")
CACHE = ("kvfid/kl_mean",)
PASSKEY = "acc/passkey"
