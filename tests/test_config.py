"""Every preset in conf/ composes and becomes its typed dataclass."""
from __future__ import annotations

import pytest

from quantlab.cli import GROUPS, presets
from quantlab.config import ModelConfig, RunConfig
from quantlab.probes.configs import ProbeConfig
from quantlab.targets.cpu import CPUTargetConfig
from quantlab.targets.cuda import CUDATargetConfig
from quantlab.targets.neuron import NeuronTargetConfig
from quantlab.schemes.base import KVScheme, WeightScheme
from quantlab.targets.llamacpp import LlamaCppTargetConfig
from quantlab.targets.vllm import VllmTargetConfig
from quantlab.schemes.float import FloatScheme
from quantlab.schemes.kv import NoKV
from tests.conftest import REPO, compose_cfg

EXTRA = {"model": {"hf": ["model.path=some/model"], "gguf": ["model.path=/x.gguf"]}}
CASES = [(g, p) for g in GROUPS if g != "sweep" for p in presets(g)]


@pytest.mark.parametrize("group,preset", CASES, ids=[f"{g}={p}" for g, p in CASES])
def test_preset_composes_to_typed_config(group, preset):
    cfg = compose_cfg([f"{group}={preset}", *EXTRA.get(group, {}).get(preset, [])])
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.model, ModelConfig)
    assert isinstance(cfg.probe, ProbeConfig)
    assert isinstance(cfg.target, (CPUTargetConfig, CUDATargetConfig, NeuronTargetConfig, LlamaCppTargetConfig,
                                   VllmTargetConfig))
    assert isinstance(cfg.scheme.kv, KVScheme) and isinstance(cfg.scheme.weights, WeightScheme)
    if group == "scheme/weights":  # run names (and the `scheme` param) are the preset names
        name = cfg.scheme.weights.short_name()  # (a mixed recipe's name says mixed and its recipe)
        assert name == preset or (preset == "mixed" and name == "mixed-custom")
    if group == "scheme/kv" and preset != "none":
        assert cfg.scheme.kv.short_name().startswith("kv")
    else:
        assert isinstance(cfg.scheme.kv, NoKV)


@pytest.mark.parametrize("sweep", presets("sweep"))
def test_sweep_files_are_global_multirun(sweep):
    cfg = compose_cfg([f"+sweep={sweep}"], to_object=False)
    assert cfg.sweep_name == sweep
    # hydra.mode lives in the hydra node, which compose() strips; read the file.
    from quantlab.cli import CONF_DIR, _check_sweep_file

    assert _check_sweep_file(CONF_DIR / "sweep" / f"{sweep}.yaml") == []


@pytest.mark.parametrize("preset,dtype", [("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16")])
def test_float_presets(preset, dtype):
    w = compose_cfg([f"scheme/weights={preset}"]).scheme.weights
    assert isinstance(w, FloatScheme) and w.dtype == dtype and w.short_name() == preset
    assert w.to_dict() == {"type": "FloatScheme", "dtype": dtype}


def test_bad_float_dtype_is_rejected():
    with pytest.raises(ValueError, match="valid: float32, float16, bfloat16"):
        FloatScheme(dtype="float8")


@pytest.mark.parametrize("args,message", [
    (["probe.latency.new_tokens=-5"], "probe.latency.new_tokens=-5: must be >= 1"),
    (["probe.latency.batch_size=0"], "probe.latency.batch_size=0: must be >= 1"),
    (["probe.latency.grid_batch_sizes=[1,0]"], "probe.latency.grid_batch_sizes=[1, 0]: must be >= 1"),
    (["probe.latency.repeats=5", "probe.latency.max_repeats=2"], "max_repeats=2: must be >= probe.latency.repeats"),
    (["probe.latency.rss_sample_hz=0"], "rss_sample_hz=0.0: must be > 0"),
    (["seed=abc"], "could not be converted to Integer"),
    (["model=hf"], "model=hf and model=gguf need model.path="),
    (["-m", "model=tiny", "scheme/weights=fp32,bf16", "probe.perplexity.window=1"],
     "probe.perplexity.window=1: must be >= 2"),
    (["scheme/weights=int3"], "unknown scheme/weights 'int3'; valid: as-is, awq-g32"),
    (["target=llamacpp", "target.n_ctx=8"], "target.n_ctx=8: must be >= 16"),  # once refused inside the point
    (["target=vllm", "target.max_num_seqs=0"], "target.max_num_seqs=0: must be >= 1"),
    (["target=vllm", "target.max_model_len=256", "probe=smoke", "probe.fidelity.windows=1"],  # was a FAILED
     # point: vLLM refused the prompt
     "probe.fidelity.tokens=512 over 1 windows needs 513 tokens of context; target.max_model_len=256 holds fewer"),
    (["probe.fidelity.tokens=10", "probe.fidelity.windows=8"],
     "probe.fidelity.tokens=10 over probe.fidelity.windows=8: each window needs >= 2 tokens"),
    (["decision.alpha=1.5"], "decision.alpha=1.5: an error rate, below 1"),
    (["decision.tie_break=smallest"], "decision.tie_break='smallest': valid: size, bits, latency"),
    (["decision.retime_rounds=3"], "decision.retime_rounds=3: 0 (no re-timing) or at least 8 rounds"),
    (["decision.latency_share=1.5"], "decision.latency_share=1.5: the latency half's share of alpha, in (0, 1)"),
    (["target=neuron", "target.sequence_length=40", "probe.fidelity.enabled=false", "probe.cache.enabled=false"],
     "probe.latency (prompt_tokens + new_tokens) needs 48 tokens of context; target.sequence_length=40"),
    (["scheme/weights=mixed", "scheme.weights.recipe=RECIPE"], "bad.yaml: not valid YAML at line 3"),
    (["probe=full", "probe.adaptive=true"],  # the one switch reaches a task it cannot score
     "(or probe.adaptive=true): lambada_openai_local, wikitext2_local cannot be scored adaptively"),
    # the calibrated schemes' shared fields, one rule each (GPTQ's once carried none: a typo ran to the point)
    (["scheme/weights=gptq-g64", "scheme.weights.calibration=wkii"], "gptq calibration 'wkii'; valid: builtin, c4, wiki"),
    (["scheme/weights=gptq-g64", "scheme.weights.n_samples=0"], "gptq n_samples 0; valid: >= 1"),
    (["scheme/weights=awq-g32", "scheme.weights.seq_len=1"], "awq seq_len 1; valid: >= 2"),
    (["scheme/weights=int8", "scheme.weights.compute_dtype=fp8"],
     "int8 compute_dtype 'fp8'; valid: bfloat16, float16, float32"),
    (["eval_seed=-1"], "eval_seed=-1: must be >= 0"),
])
def test_bad_values_fail_in_one_line_before_anything_runs(tmp_path, args, message):
    """Compose-time validation: one line naming the field, exit 2, no run
    made, and refused before torch (or any kernel library) is imported: the
    refusal took 9.5 s on 2 Xeon cores when the scheme and target modules
    were loaded to find their configs, 0.3-0.6 s since."""
    from tests.conftest import run_cli

    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: x\ndefault: [int8\n")
    args = [a.replace("RECIPE", str(recipe)) for a in args]
    proc = run_cli([*args, f"tracking.uri=sqlite:///{tmp_path}/m.db"], timeout=120, python_flags=("-X", "importtime"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("quantlab:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "m.db").exists()
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert not imported & {"torch", "transformers", "hqq", "mlflow"}, sorted(imported & {"torch", "transformers"})


def test_one_switch_makes_both_adaptive_probes_adaptive_and_round_trips():
    from quantlab.compose import config_dict, config_from_dict

    on = compose_cfg(["+sweep=fp8_vs_int4", "probe.adaptive=true"])
    assert on.probe.perplexity.adaptive and on.probe.accuracy.adaptive
    assert config_from_dict(config_dict(on)) == on
    off = compose_cfg(["+sweep=fp8_vs_int4", "probe.perplexity.adaptive=true"])
    assert off.probe.perplexity.adaptive and not off.probe.accuracy.adaptive  # false leaves each as set


def test_every_preset_passes_validation(tmp_path):
    """model.path is checked at compose time: the hf and gguf presets get a
    directory and a file that exist (the directory with what makes it a model's)."""
    from quantlab.config_check import validate

    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "x.gguf"), "llama")  # a header: what makes a file a GGUF at compose time
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").touch()
    extra = {"model": {"hf": [f"model.path={tmp_path}"], "gguf": [f"model.path={tmp_path / 'x.gguf'}"],
                       "shape": ["probe=latency"]}}  # random weights: accuracy probes are refused
    for group, preset in CASES:
        validate(compose_cfg([f"{group}={preset}", *extra.get(group, {}).get(preset, [])]))


def test_a_run_starts_without_third_party_import_noise(tmp_path):
    from tests.conftest import run_cli

    proc = run_cli(["model=tiny", "probe=smoke", "probe.latency.repeats=1", "probe.cache.enabled=false",
                    f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/a"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for noise in ("Failed to load", "Detected no triton", "register_constant"):
        assert noise not in proc.stderr + proc.stdout


def test_headline_sweep_holds_the_kv_point_and_accuracy_by_default():
    """fp8_vs_int4 adds int4-g64 + INT8 KV off the grid and defaults to the
    headline probe (accuracy + perplexity); a command-line probe= still wins."""
    from hydra import compose, initialize_config_dir

    from hydra_plugins.quantlab_sweeper import with_points
    from quantlab.cli import CONF_DIR
    from quantlab.compose import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+sweep=fp8_vs_int4"], return_hydra_config=True)
        quick = compose("config", overrides=["+sweep=fp8_vs_int4", "probe=quick"])
    assert cfg.hydra.sweeper._target_.endswith("QuantlabSweeper")
    assert list(cfg.hydra.sweeper.points) == ["scheme/weights=int4-g64 scheme/kv=int8"]
    assert cfg.probe.name == "headline" and cfg.probe.accuracy.enabled and cfg.probe.perplexity.enabled
    assert quick.probe.name == "quick"
    grid = [["scheme/weights=fp32", "probe=quick"], ["scheme/weights=int4-g64", "probe=quick"]]
    jobs = with_points(grid, ["scheme/weights=int4-g64 scheme/kv=int8", "scheme/weights=fp32"])
    assert jobs == [*grid, ["probe=quick", "scheme/weights=int4-g64", "scheme/kv=int8"]]  # fp32: already on the grid


TARGETS = presets("target")


@pytest.mark.parametrize("target", [*TARGETS, "fake"])
def test_every_targets_point_round_trips_through_its_dict(target):
    """config_dict and config_from_dict are inverses for every target's point,
    also one whose config lives beside its target (llamacpp, once a KeyError at
    export) and one registered from outside quantlab (the test engine's)."""
    from quantlab.compose import config_dict, config_from_dict
    from tests.fake_engine import FakeTargetConfig

    cfg = compose_cfg([f"target={'cpu' if target == 'fake' else target}", "scheme/weights=int4-g64",
                       "scheme/kv=int8"])
    if target == "fake":
        cfg.target = FakeTargetConfig()
    back = config_from_dict(config_dict(cfg))
    assert back == cfg and type(back.target) is type(cfg.target)
    assert config_dict(back) == config_dict(cfg)


def test_every_scheme_preset_round_trips_through_its_dict():
    """Each weight and KV preset comes back from its logged dict as itself (a
    scheme field named ``type``, the dict's own key, once made an exported
    gguf-* point unreadable)."""
    from quantlab.cli import presets
    from quantlab.compose import config_dict, config_from_dict

    for group in ("weights", "kv"):
        for name in presets(f"scheme/{group}"):
            cfg = compose_cfg([f"scheme/{group}={name}"])
            assert config_from_dict(config_dict(cfg)) == cfg, name


def test_an_unknown_config_type_is_one_line():
    from quantlab.compose import config_dict, config_from_dict

    d = config_dict(compose_cfg([]))
    d["target"]["type"] = "TPUTargetConfig"
    with pytest.raises(ValueError, match="config type 'TPUTargetConfig' is unknown to this quantlab; known: .*"
                                         "LlamaCppTargetConfig"):
        config_from_dict(d)


@pytest.mark.parametrize("override,match", [
    ("probe.load.arrival=burst", "probe.load.arrival='burst': valid: poisson, constant"),
    ("probe.load.policies=[continuous,fifo]", "probe.load.policies: unknown 'fifo'; valid: continuous, dynamic"),
    ("isolation=thread", "isolation='thread': valid: none, process"),
    ("target.compile_mode=turbo", "target.compile_mode='turbo': valid: default, max-autotune"),
])
def test_string_choices_are_checked_in_one_place(override, match):
    from quantlab.config_check import validate

    with pytest.raises(ValueError, match=match):
        validate(compose_cfg([override]))


def test_every_policy_the_config_offers_is_served():
    from quantlab.config_check import choices
    from quantlab.probes.configs import LoadProbeConfig, POLICIES
    from quantlab.serving import policies

    assert tuple(policies.NEEDS) == POLICIES == choices(LoadProbeConfig, "policies")
    with pytest.raises(ValueError, match="policies: unknown 'fifo'; valid: continuous, dynamic, passthrough"):
        policies.make_policy("fifo", None, LoadProbeConfig())


def test_a_postgres_store_without_its_driver_names_the_extra(monkeypatch):
    """Was a ``ModuleNotFoundError: No module named 'psycopg'`` when the first
    point opened the store; now refused at compose time, password hidden. The
    plain form needs the driver SQLAlchemy picks for it, which the extra
    installs; every database form is checked the same way."""
    import importlib.util

    import tomllib
    from sqlalchemy.dialects import registry

    from quantlab.config_check import validate
    from quantlab.tracking_config import TrackingConfig
    from tests.conftest import REPO

    default = registry.load("postgresql").driver  # psycopg from SQLAlchemy 2.1, psycopg2 before
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith("psycopg") else real(n, *a))
    with pytest.raises(ValueError, match=rf"uri=postgresql://\*\*\*@db:5432/mlflow: needs the {default} driver, "
                                         r"which is not installed \(pip install 'quantlab\[postgres\]'\)"):
        validate(TrackingConfig(uri="postgresql://me:secret@db:5432/mlflow"), "tracking.")
    for driver in ("psycopg", "psycopg2"):
        with pytest.raises(ValueError, match=rf"needs the {driver} driver.*quantlab\[postgres\]"):
            validate(TrackingConfig(uri=f"postgresql+{driver}://db/mlflow"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "pymysql" else real(n, *a))
    with pytest.raises(ValueError, match=r"mysql\+pymysql://db/m: needs the pymysql driver.*pip install pymysql"):
        validate(TrackingConfig(uri="mysql+pymysql://db/m"))
    with pytest.raises(ValueError, match=r"unknown database dialect 'postgres'"):
        validate(TrackingConfig(uri="postgres://db/m"))
    validate(TrackingConfig(uri="sqlite:///m.db"))
    validate(TrackingConfig(uri="http://127.0.0.1:5000"))
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = {d.split(">")[0].split("[")[0] for d in extras["postgres"]}
    assert {"psycopg", "psycopg2-binary"} <= installs and any(d.startswith("psycopg[binary]") for d in extras["dev"])


def test_a_users_own_presets_join_through_hydras_search_path(tmp_path):
    """A directory on ``hydra.searchpath`` adds presets beside the packaged
    ones: its names are accepted (and listed when one is misspelt)."""
    from tests.conftest import run_cli

    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text(
        (REPO / "conf" / "model" / "tiny.yaml").read_text().replace("name: tiny", "name: mine"))
    common = [f"hydra.searchpath=[file://{tmp_path}/conf]", "probe=smoke", "probe.latency.enabled=false",
              f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.artifact_root={tmp_path}/a"]
    out = run_cli(["model=mine", *common])
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout + out.stderr
    assert "bf16@cpu" in said and "loading model mine" in said
    bad = run_cli(["model=mien", *common])
    assert bad.returncode == 2 and "unknown model 'mien'; valid: gguf, hf, mine, shape, smollm2-135m, tiny" in bad.stderr


_CONFIG_MODULES = ("quantlab/config.py", "quantlab/schemes/configs.py", "quantlab/targets/configs.py",
                   "quantlab/schemes/base.py")


def test_no_config_checks_itself_by_hand():
    """One check style: a config declares its valid values in field metadata
    and its cross-field rules in ``check(path)``; no ``__post_init__`` raises."""
    import ast

    for rel in _CONFIG_MODULES:
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
                raises = [n.lineno for n in ast.walk(node) if isinstance(n, ast.Raise)]
                assert not raises, f"{rel}:{raises}: a hand-written check in __post_init__ (declare it in metadata)"


def _scheme_fields_with_rules():
    import dataclasses

    from quantlab.schemes import configs

    for cls in vars(configs).values():
        if isinstance(cls, type) and issubclass(cls, (WeightScheme, KVScheme)) and cls.__module__ == configs.__name__:
            for f in dataclasses.fields(cls):
                if "choices" in f.metadata or "min" in f.metadata or "rule" in f.metadata:
                    yield pytest.param(cls, f, id=f"{cls.__name__}.{f.name}")


@pytest.mark.parametrize("cls,f", list(_scheme_fields_with_rules()))
def test_a_scheme_refuses_a_bad_value_when_built_in_python_as_when_composed(cls, f):
    """Every declared rule of every scheme field refuses, naming the scheme's
    LABEL, the field and the value, at construction (no compose needed)."""
    bad = "bogus" if isinstance(f.default, str) else -7
    with pytest.raises(ValueError, match=rf"^{cls.LABEL} {f.name} {bad!r}; valid: "):
        cls(**{f.name: bad})
    cls()  # the defaults are valid
