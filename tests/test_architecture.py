"""The shape of the code stays true: layers import downwards only, no module
imports another that imports it back, the point-identity module needs the
standard library alone, and the greps the architecture promises hold.

Imports are read from the source (every ``import`` statement, also those inside
functions), so a lazy import counts like any other.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "quantlab"

# Layers from the ground up (docs/architecture.md draws them). A module may
# import its own layer and the ones below; the most specific prefix decides.
LAYERS = [
    ("base", ["errors", "digest", "point", "divergence", "decode", "stats", "uncertainty", "sequential", "pareto", "measurement",
              "hardware", "contention", "decision", "config", "corpus", "ports", "resources", "plugins", "shapes",
              "model_files", "metric_names", "artifacts", "retime", "config_check", "tracking_config", "records",
              "probes.configs"]),
    ("data", ["models", "gptq_awq", "calibration", "tracking", "tracking_server", "store_read", "plots"]),
    ("schemes", ["schemes"]),
    ("serving", ["serving"]),
    ("engines", ["engines"]),
    ("probes", ["probes"]),
    ("writers", ["export.formats", "export.checkpoint", "export.gguf", "export.roundtrip", "export"]),
    ("targets", ["targets"]),
    ("app", ["compose", "provenance", "pipeline", "report", "report_cli", "sweep", "cli",
             "capabilities", "sensitivity", "__main__", "export_run", "export_cli", "export.__main__", "console", "api",
             "retiming"]),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(tree: ast.Module):
    """Every node of ``tree`` but those under ``if __name__ == "__main__":``,
    which run only when the file is the program (``python -m``), never when
    the module is imported: no import there makes a cycle of modules."""
    for node in ast.walk(ast.Module(body=[n for n in tree.body if not (
            isinstance(n, ast.If) and ast.unparse(n.test) in ("__name__ == '__main__'", '__name__ == "__main__"'))],
            type_ignores=[])):
        yield node


def imports() -> dict[str, set[str]]:
    """quantlab module -> the quantlab modules it imports (anywhere in its
    source but a ``__main__`` guard's body)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in _imported(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[:len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def layer(module: str) -> int:
    short = module.removeprefix("quantlab").lstrip(".")
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (short == p or short.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None and short == "":
        return len(LAYERS) - 1  # the package's namespace: the Python API's facade (quantlab.api), on top
    if best is None and short in ("schemes", "engines", "probes", "serving", "targets"):
        return 0  # package markers (docstrings only)
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py: add it"
    return best


def test_the_report_and_the_run_config_are_split_into_small_modules():
    """The report's table, metric choice and verdict are a module each (one
    765-line file mixed them with the probes' sections, now the probes'), and the run's config
    holds the run's nodes (the probes' configs beside the probes, the one
    check and tracking's config apart): none over 350 lines."""
    files = [*(PKG / "report").glob("*.py"), PKG / "config.py"]
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in files}
    assert {"report/table.py", "report/metric.py", "report/verdict.py"} <= set(sizes)
    assert max(sizes.values()) < 350, sizes


def test_the_reports_table_names_no_metric_its_probes_do_not_declare():
    """The table's metric columns, their formats and which are timings come
    from the probes' declarations (quantlab.metric_names), not from names
    written in the table's code; the capacity column's level is the one the
    knee's bound uses."""
    from quantlab import metric_names, uncertainty

    code = (PKG / "report" / "table.py").read_text()
    assert not re.findall(r"[\"'](lat|tput|size|mem|fid|kvfid|load|acc|acc_norm|ppl)[/_]", code)
    assert (f"capacity {uncertainty.LEVEL:.0%} lower bound", "load/knee_rps_lower", "{:.2f}") in \
        metric_names.columns({"load/knee_rps_lower"})


# a metric's name or a family's prefix as a string literal: "lat/tpot_ms_p50", "acc/", "doc_ids/" (a unit such
# as "ms/token" is not one)
METRIC_LITERAL = re.compile(r"(?!ms/|req/|tok/)[a-z][a-z0-9_]*/[a-z0-9_]*")
# the modules that read probes' metrics, and the family each logs itself
DECIDERS = {"decision.py": None, "report/__init__.py": None, "report/metric.py": None, "report/table.py": None,
            "report/verdict.py": None, "report_cli.py": None, "plots.py": None, "pareto.py": None, "api.py": None,
            "retiming.py": "retime/"}


def metric_literals(path: Path) -> list[str]:
    """The string constants of ``path`` (f-strings' fixed parts included)
    that are a metric's name or prefix, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and METRIC_LITERAL.fullmatch(n.value)]


def test_no_metric_name_outside_the_probes_that_log_them():
    """The report, the decision, the plots and the API name no metric: what
    they read is declared with the probes (quantlab.metric_names: its
    constants and specs), and each probe's section (probes/*_report.py) is
    the probe's own; so a plugin probe reaches all of them by declaring its
    metrics and sections, with no edit here."""
    hits = {f: found for f, own in DECIDERS.items()
            if (found := [n for n in metric_literals(PKG / f) if not (own and n.startswith(own))])}
    assert hits == {}
    assert not (PKG / "serving_report.py").exists() and not (PKG / "scaling.py").exists()


def test_the_metric_literal_check_finds_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""docs name lat/tpot_ms_p50"""\nA = "lat/tpot_ms_p50"\nB = f"doc_ids/{x}"\nC = "a path/to x"\n')
    assert metric_literals(f) == ["lat/tpot_ms_p50", "doc_ids/"]


def test_export_is_one_floor_of_writers():
    """export/ holds the writers the targets import; the export command and
    its rebuild of a point (app level) live beside the other commands
    (export_cli, export_run), so no module of export/ but its ``__main__``
    shim is above the writers' floor."""
    writers = next(i for i, (n, _) in enumerate(LAYERS) if n == "writers")
    mods = [m for m in imports() if m.startswith("quantlab.export.") and not m.endswith("__main__")]
    assert mods and all(layer(m) == writers for m in mods), {m: layer(m) for m in mods}


def test_the_report_reads_records_not_mlflow_runs():
    """The report, its sections, the re-timing and the Python API read
    quantlab's records (quantlab.records), never MLflow's Run shapes."""
    files = [*(PKG / "report").glob("*.py"), *(PKG / "probes").glob("*_report.py"),
             *(PKG / f for f in ("api.py", "retiming.py"))]
    hits = [f"{p.name}: {m}" for p in files for m in re.findall(r"\.info\.\w+|\.data\.(?:metrics|tags|params)",
                                                                    p.read_text())]
    assert hits == []


def test_every_module_has_a_layer():
    for m in imports():
        layer(m)


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
           for m, deps in imports().items() for d in sorted(deps) if layer(d) > layer(m)]
    assert not bad, "\n".join(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(imports()) == []


def test_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_in_functions_count_and_a_main_guard_does_not():
    tree = ast.parse("def f():\n    import a\nif x:\n    import b\nif __name__ == '__main__':\n    import c\n")
    assert {a.name for n in _imported(tree) if isinstance(n, ast.Import) for a in n.names} == {"a", "b"}


def test_point_identity_needs_the_standard_library_only():
    tree = ast.parse((PKG / "point.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots - {"__future__"} <= set(sys.stdlib_module_names), roots


def _grep(pattern: str, where: str = "") -> list[str]:
    rx = re.compile(pattern)
    return [f"{p.relative_to(PKG.parent)}:{i}" for p in sorted(PKG.rglob("*.py")) if str(p).find(where) >= 0
            for i, line in enumerate(p.read_text().splitlines(), 1) if rx.search(line)]


def test_one_kl_per_token_function():
    assert [h.split(":")[0] for h in _grep(r"def (_?kl|kl_\w+)\(")] == ["quantlab/divergence.py"]
    # every KL over a vocabulary goes through it: no hand-written p * (log p - log q) elsewhere
    assert [h for h in _grep(r"\.exp\(\) \* \(") if not h.startswith("quantlab/divergence.py")] == []


def test_only_the_tracker_talks_to_mlflow():
    """Every MLflow read and write goes through quantlab.tracking's Tracker and
    Run: no other module imports mlflow or calls the client's methods."""
    assert [h for h in _grep(r"^\s*(import mlflow|from mlflow)") if not h.startswith("quantlab/tracking.py")] == []
    calls = r"\.(create_run|log_batch|log_artifacts?|set_terminated|search_runs|get_run|download_artifacts|set_tag)\("
    assert [h for h in _grep(calls) if not h.startswith("quantlab/tracking.py")] == []


def test_no_run_name_parsing():
    assert _grep(r'split\("@"\)') == []


@pytest.mark.parametrize("tag", ["quantlab.sweep", "quantlab.role", "quantlab.outcome", "quantlab.reason",
                                 "quantlab.reused_from", "recovery.baseline", "point_hash", "host.id"])
def test_each_tag_name_is_defined_once(tag):
    assert _grep(re.escape(f'"{tag}"')) == ["quantlab/point.py:" + _grep(re.escape(f'"{tag}"'))[0].split(":")[1]]


def test_no_scheme_type_or_attribute_tests_outside_schemes():
    from quantlab.schemes import registry

    names = sorted({t.__name__ for t in (*registry.weight_schemas().values(), *registry.kv_schemas().values())})
    outside = [p for p in PKG.rglob("*.py") if "schemes" not in p.relative_to(PKG).parts]
    hits = []
    for p in outside:
        text = p.read_text()
        for n in names:
            if re.search(rf"\b{n}\b", text):
                hits.append(f"{p.relative_to(PKG.parent)} names {n}")
        for attr in ("compute_dtype", "candidates", "input_activations", "calibration", "group_size", "symmetric"):
            if re.search(rf"getattr\(\s*(w|weights|kv|cfg\.scheme\.\w+)\s*,\s*\"{attr}\"", text) \
                    or re.search(rf"\b(w|weights|cfg\.scheme\.weights)\.{attr}\b", text):
                hits.append(f"{p.relative_to(PKG.parent)} reads the scheme's {attr}")
    assert hits == []


def test_entry_points_name_what_the_handlers_register():
    """The schemes and targets declared as entry points (composed without
    torch) are what their HANDLER / MODULE modules register once imported, and
    every one of quantlab's own has a preset of its schema under conf/."""
    from quantlab import targets
    from quantlab.schemes import registry

    assert registry.registered() == (registry.weight_schemas(), registry.kv_schemas())
    assert set(targets.declared().values()) <= set(targets.registered())
    conf = PKG.parent / "conf"
    for group, table in (("scheme/weights", registry.weight_schemas()), ("scheme/kv", registry.kv_schemas()),
                         ("target", targets.declared())):
        for name in table:
            assert any(f"- _{name}\n" in p.read_text() for p in (conf / group).glob("*.yaml")), (group, name)


def test_the_architecture_diagram_names_every_module():
    """docs/architecture.md's layer diagram lists every module of quantlab/."""
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    block = re.search(r"## Layers.*?```\n(.*?)```", text, re.S)[1]
    words = set(re.findall(r"[\w.]+", block))
    packages = ("schemes", "engines", "probes", "serving", "serving.vllm_site", "targets", "export")
    missing = []
    for m in imports():
        parts = m.removeprefix("quantlab").lstrip(".").split(".")
        if parts == [""] or ".".join(parts) in packages or parts[-1] == "__main__":
            continue
        if not any(".".join(parts[i:]) in words for i in range(len(parts))):  # its name, or a dotted tail of it
            missing.append(m)
    assert missing == []
