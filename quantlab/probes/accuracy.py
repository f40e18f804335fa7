"""lm-eval on the point's engine (in-process PyTorch, llama.cpp, the Neuron worker).

Standard harness task names work when the hub is reachable; ``*_local`` tasks
read the benchmark files under the data directory (see ``evaluation/``). Every
point of a sweep evaluates the same documents: with ``limit`` set, indices are
drawn once per task from a seeded RNG and passed to lm-eval as ``samples``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from pathlib import Path

from quantlab.probes.configs import AccuracyProbeConfig
from quantlab.digest import computed_once, write_atomic
from quantlab.errors import UserError
from quantlab.resources import data_dir
from quantlab.uncertainty import mean_stderr

log = logging.getLogger("quantlab")

TEMPLATES = data_dir("evaluation")
# task -> (files under data_dir it needs, converter writing <prepared>/<name>.jsonl)
LOCAL_FILES = {
    "lambada_openai_local": ["lambada/lambada_test.jsonl"],
    "hellaswag_local": ["hellaswag/hellaswag_val_full.txt"],
    "arc_easy_local": ["arc/arc_easy_test.jsonl"],
    "arc_challenge_local": ["arc/arc_challenge_test.jsonl"],
    "piqa_local": ["piqa/valid.jsonl", "piqa/valid-labels.lst"],
    "winogrande_local": ["winogrande/winogrande_dev.jsonl"],
    "boolq_local": ["boolq/boolq_validation.jsonl"],
    "wikitext2_local": ["wikitext-2-raw/wiki.test.raw"],
}


# helper modules (under evaluation/) a task's YAML loads with !function
HELPERS = {"wikitext2_local": ("preprocess_wikitext.py",)}
FORMAT = 2  # version of the prepared JSONL; 2: wikitext pages as lm-eval's, not detokenized


def local_tasks() -> list[str]:
    return sorted(LOCAL_FILES)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _hellaswag(d: Path) -> list[dict]:
    lines = (d / "hellaswag/hellaswag_val_full.txt").read_text(encoding="utf-8").split("\n")
    return [{"query": lines[i], "label": int(lines[i + 1]), "choices": lines[i + 2:i + 6]}
            for i in range(0, len(lines) - 5, 6)]


def _piqa(d: Path) -> list[dict]:
    labels = (d / "piqa/valid-labels.lst").read_text().split()
    return [{**doc, "label": int(lab)} for doc, lab in zip(_jsonl(d / "piqa/valid.jsonl"), labels, strict=True)]


def _wikitext_pages(d: Path) -> list[dict]:
    """The test file cut into articles as ``EleutherAI/wikitext_document_level``
    (lm-eval's ``wikitext`` dataset) cuts it: a line that is a level-1 title
    starts a page, lines are joined with newlines, nothing is detokenized or
    stripped. lm-eval's own ``process_results`` counts words and bytes on this
    original page and its own detokenizer makes the scored text (see the task
    YAML), so word and byte perplexity mean what they mean in lm-eval."""
    lines = (d / "wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8").split("\n")
    pages, page = [], []
    for line in lines:
        flat = line.replace("= = =", "===").replace("= =", "==").strip()
        if flat.startswith("= ") and flat.endswith(" ="):
            if "\n".join(page).strip():
                pages.append({"page": "\n".join(page)})
            page = []
        page.append(line)
    pages.append({"page": "\n".join(page)})
    return pages


CONVERTERS = {
    "lambada_openai_local": ("lambada_openai", lambda d: _jsonl(d / "lambada/lambada_test.jsonl")),
    "hellaswag_local": ("hellaswag", _hellaswag),
    "arc_easy_local": ("arc_easy", lambda d: _jsonl(d / "arc/arc_easy_test.jsonl")),
    "arc_challenge_local": ("arc_challenge", lambda d: _jsonl(d / "arc/arc_challenge_test.jsonl")),
    "piqa_local": ("piqa", _piqa),
    "winogrande_local": ("winogrande", lambda d: _jsonl(d / "winogrande/winogrande_dev.jsonl")),
    "boolq_local": ("boolq", lambda d: _jsonl(d / "boolq/boolq_validation.jsonl")),
    "wikitext2_local": ("wikitext2", _wikitext_pages),
}


def prepare_tasks(tasks: list[str], data_dir: str | None, cache_dir: str) -> tuple[Path, dict[str, int]]:
    """Write JSONL + rendered YAML for the local tasks among ``tasks``.

    Returns the include directory for lm-eval and the document count per local
    task. A missing file raises one line naming the task and the expected path.
    """
    local = [t for t in tasks if t in LOCAL_FILES]
    root = Path(data_dir).expanduser() if data_dir else None
    for t in local:
        for f in LOCAL_FILES[t]:
            if root is None:
                raise UserError(f"task {t} needs data_dir (or QUANTLAB_DATA_DIR) holding {f}")
            if not (root / f).is_file():
                raise UserError(f"task {t}: expected {root / f}")
    key = hashlib.sha256(json.dumps([FORMAT, str(root), sorted(local)]).encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() / "tasks" / key
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for t in local:
        name, convert = CONVERTERS[t]
        path = out / f"{name}.jsonl"  # points (nodes, on a shared cache_dir) preparing at once: written once
        computed_once(path, lambda p: None, lambda: convert(root),
                      lambda docs, tmp: tmp.write_text("".join(json.dumps(doc) + "\n" for doc in docs),
                                                       encoding="utf-8"))
        counts[t] = sum(1 for _ in path.open(encoding="utf-8"))
        template = (TEMPLATES / f"{t}.yaml").read_text()
        write_atomic(out / f"{t}.yaml", template.replace("{prepared}", str(out)))
        for helper in HELPERS.get(t, ()):  # task code the YAML names with !function
            write_atomic(out / helper, (TEMPLATES / helper).read_text())
    return out, counts


def sample_indices(n_docs: int, limit: int | None, seed: int, task: str) -> list[int] | None:
    """The same ``limit`` documents of ``task`` for every point (None: all)."""
    if limit is None or limit >= n_docs:
        return None
    return sorted(sample_order(n_docs, limit, seed, task))


def sample_order(n_docs: int, limit: int | None, seed: int, task: str) -> list[int]:
    """:func:`sample_indices`' documents in the order they were drawn (every
    document, in a seeded random order, when ``limit`` covers them all): any
    prefix is a uniform random sample of the task (adaptive evaluation)."""
    rng = random.Random(f"{seed}:{task}")
    return rng.sample(range(n_docs), min(limit or n_docs, n_docs))


def evaluate(engine, tokenizer, cfg: AccuracyProbeConfig, data_dir: str | None,
             cache_dir: str, seed: int) -> tuple[dict[str, float], dict, dict[str, list[float]]]:
    """Run the configured tasks on ``engine``; return flat metrics
    (``acc/arc_easy_local`` and its ``acc_stderr/arc_easy_local``), lm-eval's
    per-task results (for the JSON artifact) and the per-document scores
    (``acc/arc_easy_local`` -> 0/1 per document, ``doc_ids/arc_easy_local``)."""
    from quantlab.probes.lm_adapter import EngineLM

    include, counts = prepare_tasks(list(cfg.tasks), data_dir, cache_dir)
    lm = EngineLM(engine, tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length)
    if all(t in counts for t in cfg.tasks):  # seeded random subset, same for every point
        samples = {t: idx for t in cfg.tasks
                   if (idx := sample_indices(counts[t], cfg.limit, seed, t)) is not None}
        limit = None
    else:  # hub tasks: lm-eval's own (first-N) limit; it cannot mix limit and samples
        samples, limit = {}, cfg.limit
    res = run_lm_eval(lm, list(cfg.tasks), include, seed, samples or None, limit)
    items = document_scores(res.get("samples", {}))
    metrics = flatten_results(res["results"])
    metrics.update(item_stderrs(items))
    return metrics, res["results"], items


@functools.lru_cache(maxsize=4)
def task_manager(include: str):
    """lm-eval's task index over its own tasks and quantlab's under
    ``include``, built once per process: indexing reads every task YAML
    lm-eval ships (seconds), which each adaptive look paid again."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include)


def run_lm_eval(lm, tasks: list[str], include: Path, seed: int, samples: dict[str, list[int]] | None,
                limit: int | None = None) -> dict:
    """lm-eval's ``simple_evaluate`` on ``lm`` (an :class:`EngineLM`), seeded,
    its per-document samples logged, no bootstrap."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, samples=samples, limit=limit,
                           task_manager=task_manager(str(include)), log_samples=True,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                           fewshot_random_seed=seed, bootstrap_iters=0)


# lm-eval metrics whose per-document value is the document's log-likelihood
# (aggregated as exp(-mean)): kept as NLL so that lower is better per item too
# and the paired mean difference is ln(PPL(point) / PPL(base)).
LOGLIKELIHOOD_ITEMS = ("perplexity",)


def document_scores(samples: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Per-document scores from lm-eval's logged samples, in doc-id order:
    ``{"acc/<task>": [...], "doc_ids/<task>": [...]}`` for every numeric metric
    that scores one document: 0/1 for acc, acc_norm, exact_match; the
    document's negative log-likelihood for ``perplexity`` (LAMBADA: lm-eval
    logs the log-likelihood, whose sign would read as a gain). Not
    corpus-level perplexities, whose per-document values are tuples."""
    out: dict[str, list[float]] = {}
    for task, rows in samples.items():
        rows = sorted(rows, key=lambda r: r["doc_id"])
        for metric in rows[0].get("metrics", []) if rows else []:
            values = [r.get(metric) for r in rows]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                sign = -1.0 if metric in LOGLIKELIHOOD_ITEMS else 1.0
                out[f"{metric}/{task}"] = [sign * float(v) for v in values]
        if any(k.endswith(f"/{task}") for k in out):
            out[f"doc_ids/{task}"] = [float(r["doc_id"]) for r in rows]
    return out


def item_stderrs(items: dict[str, list[float]]) -> dict[str, float]:
    """The standard error each per-document list gives, named as the report
    reads it: ``acc_stderr/<task>`` for scores, ``perplexity/<task>_ln_stderr``
    (the se of ln PPL, i.e. of the mean NLL) for log-likelihood metrics."""
    out = {}
    for k, v in items.items():
        metric, _, task = k.partition("/")
        if metric == "doc_ids":
            continue
        out[f"{k}_ln_stderr" if metric in LOGLIKELIHOOD_ITEMS else f"{metric}_stderr/{task}"] = mean_stderr(v)
    return out


def flatten_results(results: dict) -> dict[str, float]:
    """``{"arc_easy_local": {"acc,none": 0.5}}`` -> ``{"acc/arc_easy_local": 0.5}``."""
    out = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if filt in ("none", "") else f"{metric}_{filt}"
            out[f"{name}/{task}"] = float(value)
    return out
