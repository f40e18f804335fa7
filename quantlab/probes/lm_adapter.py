"""lm-eval's ``LM`` contract over any :class:`~quantlab.engines.base.Engine`.

Tokenization, empty-context handling and request encoding are lm-eval's own
(``TemplateLM``); scoring reads ``engine.token_logprobs``: each request's context and
continuation, left-truncated to ``max_length + 1`` tokens minus the last, one
forward for a right-padded batch (causal attention: padding after a row's end
cannot change its logits; the head runs from the batch's earliest continuation
token on, where the engine can skip the rest: 42 % of ARC-Easy's positions,
83 % of PIQA's at batch 16), the continuation's log-probs summed, and greedy
when every continuation token is the argmax — what HFLM computes, on whichever
runtime the point runs (tested for parity with HFLM on the same model).

Scores do not depend on the batch: a row's padded width (its length rounded
up to :data:`WIDTH_STEP` tokens) is a function of the row alone, and only
rows of one width share a batch. Without this, a bf16 row's log-likelihood
moved by up to 2.5e-3 nats with the width of the batch it was padded into
(fp32: 1e-6), enough to flip a near-tie answer between a fixed design (all
documents at once) and adaptive looks, or between a point and its reference.
"""
from __future__ import annotations

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM

from quantlab.errors import UserError


WIDTH_STEP = 32  # padded widths are multiples of this (at most max_length + 1): ~16 wasted tokens a row


def padded_width(n: int, cap: int) -> int:
    """The width a row of ``n`` tokens is padded to: ``n`` rounded up to
    :data:`WIDTH_STEP`, at most ``cap`` (the longest row, ``max_length + 1``)."""
    return min(-(-n // WIDTH_STEP) * WIDTH_STEP, cap)


class EngineLM(TemplateLM):
    def __init__(self, engine, tokenizer, batch_size: int = 8, max_length: int | None = None):
        super().__init__()
        self.engine, self.tokenizer = engine, tokenizer
        self.batch_size = batch_size
        self._max_length = max_length or engine.max_length

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False  # the string carries its BOS already
        return self.tokenizer.encode(string, **kw)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        cap = self.max_length + 1
        rows = [(r[1] + r[2])[-cap:] for r in requests]
        width = [padded_width(len(r), cap) for r in rows]
        order = sorted(range(len(requests)), key=lambda i: (-width[i], -len(rows[i])))
        batches, cur = [], []
        for i in order:  # consecutive rows of one width, at most batch_size of them
            if cur and (width[cur[0]] != width[i] or len(cur) == self.batch_size):
                batches.append(cur)
                cur = []
            cur.append(i)
        batches += [cur] if cur else []
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for idx in batches:
            w = width[idx[0]]
            ids = torch.tensor([rows[i] + [0] * (w - len(rows[i])) for i in idx], dtype=torch.long)
            # only continuations are read: predictions before the earliest one are not computed
            first = max(0, min(min(len(rows[i]) - 1 - len(requests[i][2]) for i in idx), w - 2))
            logp, top1 = self.engine.token_logprobs(ids, first)  # [B, w - 1 - first]; right padding unread
            for j, i in enumerate(idx):
                n, cont = len(rows[i]) - 1 - first, requests[i][2]
                span = slice(n - len(cont), n)
                answer = (float(logp[j, span].sum()), bool(top1[j, span].all()))
                out[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Disjoint ``max_length`` windows over each document, as HFLM scores them."""
        out = []
        for (string,) in (r.args for r in requests):
            windows = [(None, *w) for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))]
            out.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise UserError("generation tasks (generate_until) are not supported by quantlab's accuracy probe; "
                        "use log-likelihood tasks (arc, piqa, hellaswag, winogrande, boolq, lambada, wikitext)")
