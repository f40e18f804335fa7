"""Hydra entry point: ``python -m quantlab [+sweep=NAME] [group=option ...]``.

    python -m quantlab +sweep=smoke                       # offline smoke sweep
    python -m quantlab model=tiny scheme/weights=fp16     # one point
    python -m quantlab -m scheme/weights=fp32,bf16        # ad-hoc multirun

Before Hydra composes anything, config-group choices on the command line are
checked against ``conf/`` so a typo fails with one line listing valid names.
"""
from __future__ import annotations

import importlib.util
import logging
import re
import shutil
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from quantlab.compose import plugin_presets, register_configs
from quantlab import artifacts, point, tracking_server
from quantlab.config import MODEL_PATH_HINT, RunConfig, check_this_machine
from quantlab.config_check import validate
from quantlab.errors import UserError
from quantlab.resources import data_dir

CONF_DIR = data_dir("conf")
GROUPS = ("model", "scheme/weights", "scheme/kv", "target", "probe", "tracking", "sweep")
_OVERRIDE = re.compile(r"^[+~]{0,2}(?P<key>[\w/]+)=(?P<value>.*)$")

log = logging.getLogger("quantlab")


def presets(group: str, extra: tuple[Path, ...] = ()) -> list[str]:
    """Names of the presets of a config group (schemas ``_x`` excluded):
    quantlab's YAML ones, those of the ``extra`` config directories, and the
    schemes and targets plugin packages register (each its own preset)."""
    return sorted({p.stem for d in (CONF_DIR, *extra) for p in (d / group).glob("*.yaml")
                   if not p.stem.startswith("_")} | set(plugin_presets(group)))


def search_dirs(argv: list[str]) -> tuple[Path, ...]:
    """The directories a ``hydra.searchpath=[file:///dir,...]`` override adds
    to the config search path: a user's own presets beside quantlab's."""
    dirs = []
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "hydra.searchpath":
            dirs += [Path(item.strip(" '\"").removeprefix("file://")) for item in value.strip("[]").split(",")
                     if item.strip(" '\"").startswith("file://")]
    return tuple(dirs)


def check_overrides(argv: list[str]) -> list[str]:
    """Validate group choices; return warnings. Raises UserError on unknown names."""
    warnings, extra = [], search_dirs(argv)
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if not m or m["key"] not in GROUPS or "(" in m["value"]:
            continue
        valid = presets(m["key"], extra)
        for choice in filter(None, m["value"].split(",")):
            if choice not in valid:
                raise UserError(f"unknown {m['key']} {choice!r}; valid: {', '.join(valid)}")
            if m["key"] == "sweep":
                path = next(p for d in (CONF_DIR, *extra) if (p := d / "sweep" / f"{choice}.yaml").is_file())
                warnings += _check_sweep_file(path)
    return warnings


def _check_sweep_file(path: Path) -> list[str]:
    head = path.read_text()
    if not any(line.strip() == "# @package _global_" for line in head.splitlines()[:3]):
        return [f"{path.name} lacks '# @package _global_': Hydra would silently run ONE point"]
    if "MULTIRUN" not in head:
        return [f"{path.name} does not set hydra.mode: MULTIRUN: it runs a single point"]
    return []


# Mandatory fields a preset leaves open, and what to say when they stay open.
_REQUIRED = {"model.path": MODEL_PATH_HINT}


def to_point(cfg: DictConfig) -> RunConfig:
    """The typed, range-checked config of one point. Raises UserError with one
    line naming the field (Hydra's and OmegaConf's own errors span several)."""
    try:
        run_cfg = OmegaConf.to_object(cfg)
        validate(run_cfg)
        run_cfg.scheme.weights = run_cfg.scheme.weights.for_model(run_cfg.model)
    except (ValueError, OmegaConfBaseException) as e:
        text = str(e)
        for key, hint in _REQUIRED.items():
            if f"Missing mandatory value: {key}" in text or "${" + key + "}" in text:
                raise UserError(hint) from None
        raise UserError(f"invalid config: {_one_line(e)}") from None
    return run_cfg


def _one_line(e: BaseException) -> str:
    """First line of an error and of its cause, plus the key OmegaConf names."""
    parts = [str(e).splitlines()[0]]
    if e.__cause__ is not None and str(e.__cause__):
        parts.append(str(e.__cause__).splitlines()[0])
    key = getattr(e, "full_key", None) or getattr(e.__cause__, "full_key", None)
    if key and key not in " ".join(parts):
        parts.append(f"(key {key})")
    return ": ".join(parts)


def preflight(argv: list[str]) -> RunConfig:
    """Compose and check the first point of the command line before Hydra
    starts anything, so a bad value (``seed=abc``, ``probe.latency.new_tokens=-5``)
    fails in one line with exit 2, not after a sweep's parent run is made;
    this machine's data directory and memory too, where the points run here
    (:func:`quantlab.config.check_this_machine`).
    A single point whose model and weight scheme do not go together (a
    checkpoint quantized elsewhere without ``scheme/weights=as-is``, or
    ``as-is`` on a float model) is refused too; in a sweep that point is
    skipped with the same reason.
    Returns the first point's typed config (its tracking settings start or
    check the store before anything else)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
        first = [f"{o.get_key_element()}={next(o.sweep_string_iterator())}" if o.is_sweep_override() else o.input_line
                 for o in parsed if not o.key_or_group.startswith("hydra") or o.key_or_group == "hydra.searchpath"]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=first)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UserError(f"invalid config: {_one_line(e)}") from None
    point = to_point(cfg)
    swept = "-m" in argv or "--multirun" in argv or any(o.is_sweep_override() for o in parsed) or \
        any(a.lstrip("+").startswith("sweep=") for a in argv)
    if not swept and (why := artifacts.mismatch(point)):  # in a sweep: that point is skipped with it
        raise UserError(f"invalid config: {why}")
    check_launcher(argv, point.tracking.uri)
    if not {"hydra/launcher=ray", "hydra/launcher=slurm"} & {a.lstrip("+~") for a in argv}:  # else each node its own
        try:
            check_this_machine(point)
        except ValueError as e:
            raise UserError(f"invalid config: {e}") from None
    return point


def _say_if_engine_missing(point: RunConfig) -> None:
    """One line, before any model loads, when the first point's target has no
    engine here (vLLM's venv not built, no CUDA device): each of its points
    is recorded as skipped with this reason, at no model-loading cost."""
    from quantlab import targets

    target = targets.get(point.target)
    if target.hardware() is None:
        print(f"quantlab: warning: target={point.target.name}: {target.missing_reason()}; its points are recorded "
              "as skipped", file=sys.stderr, flush=True)


FILE_STORES = ("sqlite:", "file:", "/", ".")


def check_launcher(argv: list[str], tracking_uri: str) -> None:
    """``hydra/launcher=ray``: the plugin must be installed, and points on a
    cluster (``hydra.launcher.ray.init.address`` set) cannot share a file
    store: each node would write its own. ``hydra/launcher=slurm``: the
    plugin and SLURM's ``sbatch`` must be there, and the store a server (the
    jobs run on other nodes). Raises UserError in one line."""
    given = dict(a.lstrip("+~").split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    launcher = given.get("hydra/launcher")
    if launcher == "slurm":
        if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
            raise UserError("hydra/launcher=slurm needs the submitit launcher: pip install -e \".[slurm]\"")
        if shutil.which("sbatch") is None:
            raise UserError("hydra/launcher=slurm: sbatch not found on PATH (run from a SLURM login node)")
        if tracking_uri.startswith(FILE_STORES):
            raise UserError(f"hydra/launcher=slurm: jobs on other nodes cannot write the file store {tracking_uri}; "
                            "log to a tracking server (tracking=server tracking.uri=http://head:5000)")
        return
    if launcher != "ray":
        return
    if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        raise UserError("hydra/launcher=ray needs the Ray launcher: pip install -e \".[ray]\"")
    address = given.get("hydra.launcher.ray.init.address", "null")
    if address in ("null", "None", "", "local"):
        return
    if tracking_uri.startswith(FILE_STORES):
        raise UserError(f"hydra/launcher=ray at {address}: points on other nodes cannot write the file store "
                        f"{tracking_uri}; log to a tracking server (tracking=server tracking.uri=http://head:5000)")
    if why := _unreachable(address):
        raise UserError(f"hydra/launcher=ray: cluster {address} {why}; start one (ray start --head) or fix "
                        "hydra.launcher.ray.init.address")


def _unreachable(address: str, timeout_s: float = 5.0) -> str:
    """'' when a Ray cluster answers at ``address`` (``auto``: the one this
    machine's ``ray start`` recorded; ``[ray://]host:port``: a TCP connect)."""
    if address == "auto":
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        return "" if current.is_file() else "not found: no Ray instance runs on this machine"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        return f"unreachable ({e})"
    return ""


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(cfg: DictConfig) -> None:
    from quantlab.pipeline import run_point

    try:
        run_cfg = to_point(cfg)
    except UserError as e:
        if _in_multirun():  # the other points of the sweep still run
            log.error(f"quantlab: {e}")
            return
        print(f"quantlab: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        result = run_point(run_cfg, point.parent_run())
    except UserError as e:  # store unusable: nothing was run
        print(f"quantlab: {e}", file=sys.stderr)
        sys.exit(2)
    if result.outcome == "failed" and not _in_multirun():
        sys.exit(1)


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def main(argv: list[str] | None = None, prog: str = "python -m quantlab") -> int:
    """``python -m quantlab ARGS`` / ``quantlab run ARGS``: Hydra reads its
    arguments from ``sys.argv``, so ``argv`` (when given) replaces them. Exit
    status 2 with one line for a config or store error; 1 when a lone point
    failed."""
    if argv is not None:
        sys.argv = [prog, *argv]
    # conf/hydra/launcher/ray.yaml is checked against the Ray plugin's schema of the same name, as intended;
    # Hydra 1.3 warns that this matching is deprecated (four times a run) but keeps doing it
    warnings.filterwarnings("ignore", message=r"\n'hydra/launcher/ray' is validated against ConfigStore schema")
    register_configs()
    try:
        for w in check_overrides(sys.argv[1:]):
            print(f"quantlab: warning: {w}", file=sys.stderr)
        first = preflight(sys.argv[1:])
        with tracking_server.ensure(first.tracking):
            _say_if_engine_missing(first)  # after the store answers: this imports torch (seconds)
            from quantlab.probes import runner

            runner.registered()  # a plugin that cannot load: one line now, not a failed run per point
            _main()
    except UserError as e:
        print(f"quantlab: {e}", file=sys.stderr)
        sys.exit(2)
    return 0
