"""MLflow: one parent run per sweep, one nested child run per point.

:func:`connect` opens a :class:`Tracker` (one store and experiment: start a
run, find a sweep, a point's earlier runs, the runs a dead process left); a
:class:`Run` is one run's handle (log, tag, write an artifact, end). Both
hold an ``MlflowClient`` with explicit run ids rather than the fluent API, so
several points (or processes) never fight over a global "active run", and no
other module of quantlab calls the client.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

import psutil

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.time import get_current_time_millis

from quantlab import tracking_server
from quantlab.errors import UserError
from quantlab.point import (CREATE_KEY_TAG, HASH_TAG, HOST_ID_TAG, HOST_TAG, OUTCOME_TAG, PARENT_TAG, PID_START_TAG,
                            PID_TAG, REASON_TAG, REUSED_FROM_TAG, ROLE_SWEEP, ROLE_TAG, SWEEP_TAG, find_sweep,
                            recommended_point_tag)
from quantlab.tracking_config import TrackingConfig

log = logging.getLogger("quantlab")
T = TypeVar("T")

ITEMS_ARTIFACT = "items.json"
_BATCH = 100  # MLflow's log_batch limit on params per call
_LOCKED = ("database is locked", "database table is locked")
# How long a point (or the sweep's closing step) waits for a tracking server
# that stopped answering: about MLflow's own retry budget for a request
# (7 retries, backoff factor 2: ~4 minutes), so a server restarted within it
# loses nothing. Checks before any work starts wait 0 s (one line, exit 2).
SERVER_WAIT_S = 300.0
_ANSWERED: set[str] = set()  # server URIs that answered this process: only those are waited for


def retry(fn: Callable[..., T] | None = None, *, resend: bool = True):
    """Retry on SQLite writer contention (parallel workers on one .db file),
    with exponential backoff up to ~30 s, and (``resend``) send again a request a tracking
    server that answered this process before dropped without an answer (killed
    or restarted while it read or answered: :func:`_dropped_by`), once it
    answers again (waited for up to :data:`SERVER_WAIT_S`, at most three
    outages a call); any other error passes through.

    With ``resend``, ``fn`` must be safe to call twice: what it sends the
    second time lands as a no-op or is found (the same tags, params and
    metrics with their timestamps; a create whose twin its key finds). Used
    bare (``@retry``) or as ``@retry(resend=False)``."""
    if fn is None:
        return functools.partial(retry, resend=resend)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        delay, outages = 0.05, 0
        for attempt in range(12):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - filtered on the message below
                if resend and (server := _dropped_by(e)) and outages < 3:
                    outages += 1
                    log.warning("tracking server %s dropped a request (%s): sending it again once it answers",
                                server, str(e).splitlines()[0].split(" failed with ", 1)[1][:160])
                    _check_server(server, SERVER_WAIT_S)
                    continue
                if attempt == 11 or not any(s in str(e) for s in _LOCKED):
                    raise
                log.debug("tracking store locked, retrying in %.2fs", delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    return wrapper


def _dropped_by(e: Exception) -> str | None:
    """The URI of the tracking server a request failed on without an HTTP
    answer (MLflow's "API request to URL failed with exception ...": refused,
    reset, closed without a response, timed out), when that server answered
    this process before; None for anything else (an HTTP error status, a
    server never reached: a wrong URI fails at once)."""
    if not isinstance(e, MlflowException):
        return None
    head = str(e).splitlines()[0] if str(e) else ""
    if not head.startswith("API request to ") or " failed with " not in head or " error code " in head:
        return None
    url = head[len("API request to "):].split(" ", 1)[0]
    return next((u for u in sorted(_ANSWERED) if url.startswith(u.rstrip("/") + "/")), None)


@retry
def connect(cfg: TrackingConfig, wait_s: float = 0.0) -> Tracker:
    """The store's :class:`Tracker` on experiment ``cfg.experiment``; creates
    the local store/experiment if needed.

    Fails with one line when the store is unusable; a tracking server that
    does not answer is waited for up to ``wait_s`` seconds first (points pass
    :data:`SERVER_WAIT_S`: a server restarted mid-sweep costs them a pause,
    not the point).
    """
    uri = cfg.uri
    if uri.startswith("sqlite:///"):
        if why := tracking_server.store_unusable(uri):  # its folder is made there
            raise UserError(f"tracking store {uri}: {why}")
        if (db := Path(uri[len("sqlite:///"):])).is_file():
            relocate_artifacts(db)
    if uri.startswith(("http://", "https://")):
        _check_server(uri, wait_s)
    client = MlflowClient(tracking_uri=uri)
    try:
        exp = client.get_experiment_by_name(cfg.experiment)
        if exp is not None:
            return Tracker(client, exp.experiment_id)
        artifacts = None
        if cfg.artifact_root:
            artifacts = Path(cfg.artifact_root).expanduser().resolve().as_uri()
        try:
            return Tracker(client, client.create_experiment(cfg.experiment, artifact_location=artifacts))
        except mlflow.exceptions.MlflowException as e:  # two sweeps (or points) on a new store created it at once
            if e.error_code != "RESOURCE_ALREADY_EXISTS" or (exp := client.get_experiment_by_name(
                    cfg.experiment)) is None:
                raise
            return Tracker(client, exp.experiment_id)
    except mlflow.exceptions.MlflowException as e:
        if _dropped_by(e):  # sent again by retry once the server answers
            raise
        raise UserError(f"tracking store {uri} unusable: {str(e).splitlines()[0]}") from e


def relocate_artifacts(db: Path) -> int:
    """Make a moved or copied local store work where it now is.

    MLflow stores artifact locations as absolute ``file://`` URIs, so a store
    directory that moved (``mv mlruns elsewhere/``, a copy on another machine)
    points its runs at artifacts that are no longer there. For each experiment
    whose artifact directory is missing while a directory of the same name
    sits next to the database (quantlab's layout: ``mlruns/mlflow.db`` beside
    ``mlruns/artifacts``), the experiment's and its runs' artifact URIs are
    rewritten to the new place, and one line says so. Returns the number of
    experiments moved."""
    import sqlite3
    from urllib.parse import unquote, urlparse

    moved = 0
    with sqlite3.connect(db) as con:
        for exp_id, location in con.execute("SELECT experiment_id, artifact_location FROM experiments").fetchall():
            if not location or not location.startswith("file://"):
                continue
            old = Path(unquote(urlparse(location).path))
            new = db.parent.resolve() / old.name
            if old.exists() or not new.is_dir() or new == old:
                continue
            old_uri, new_uri = location, new.as_uri()
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new_uri, exp_id))
            con.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE experiment_id = ? "
                        "AND substr(artifact_uri, 1, ?) = ?",
                        (new_uri, len(old_uri) + 1, exp_id, len(old_uri), old_uri))
            log.warning("tracking store moved: artifacts of experiment %s now read from %s (were %s)",
                        exp_id, new, old)
            moved += 1
    return moved


def _check_server(uri: str, wait_s: float = 0.0, timeout: float = 5.0) -> None:
    """Quick requests rather than MLflow's retries with backoff (minutes): an
    unreachable server fails in seconds, or once ``wait_s`` has passed."""
    deadline, warned = time.monotonic() + wait_s, False
    while why := tracking_server.unreachable(uri, timeout):
        if time.monotonic() >= deadline:
            raise tracking_server.refused(uri, why, wait_s)
        if not warned:
            log.warning("tracking server %s unreachable (%s): waiting up to %.0f s for it", uri, why, wait_s)
            warned = True
        time.sleep(2.0)
    _ANSWERED.add(uri)
    if warned:
        log.warning("tracking server %s answers again", uri)


def answered(uri: str) -> bool:
    """Whether the tracking server at ``uri`` answered this process before (a
    server that then stops answering went away mid-work: worth waiting for)."""
    return uri in _ANSWERED


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists and None become strings."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = str(v)
    return out


@dataclass(frozen=True)
class Run:
    """One run's handle: what a point, a sweep or an export writes to it."""

    tracker: Tracker
    id: str

    @property
    def client(self) -> MlflowClient:
        return self.tracker.client

    def get(self):
        """The run as MLflow has it now (``info``, ``data.tags``, ``data.metrics``)."""
        return self.tracker.get(self.id)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        now = get_current_time_millis()  # stamped once: a batch sent again lands as a no-op
        items = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self._log_metric_batch(items[i:i + 1000])

    @retry
    def _log_metric_batch(self, items: list[Metric]) -> None:
        self.client.log_batch(self.id, metrics=items)

    @retry
    def log_params(self, params: dict[str, str]) -> None:
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.id, params=items[i:i + _BATCH])

    def log_measurement(self, m) -> None:
        """One point's :class:`~quantlab.measurement.Measurement`: tags, metrics, artifacts."""
        if m.tags:
            self.set_tags(m.tags)
        if getattr(m, "params", None):
            self.log_params(m.params)
        if m.metrics:
            self.log_metrics(m.metrics)
        for name, text in m.artifacts.items():
            self.log_text(text, name)
        if m.items:
            self.log_text(json.dumps(m.items, separators=(",", ":")), ITEMS_ARTIFACT)

    @retry
    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    @retry
    def log_text(self, text: str | bytes, name: str) -> None:
        """One artifact ``name`` holding ``text`` (bytes are written as they are: a PNG)."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / name
            if isinstance(text, bytes):
                path.write_bytes(text)
            else:
                path.write_text(text)
            self.client.log_artifact(self.id, str(path))

    @retry
    def log_files(self, path: Path, under: str | None = None) -> None:
        """A file, or a directory's files (under artifact folder ``under``)."""
        if path.is_dir():
            self.client.log_artifacts(self.id, str(path), artifact_path=under)
        else:
            self.client.log_artifact(self.id, str(path), artifact_path=under)

    @retry
    def set_status(self, status: str) -> None:
        """End the run as MLflow's ``FINISHED``, ``FAILED`` or ``KILLED``."""
        self.client.set_terminated(self.id, status)

    def end(self, outcome: str, reason: str = "") -> None:
        """Close a point's run. ``skipped`` is FINISHED with the outcome tag (nothing broke)."""
        tags = {OUTCOME_TAG: outcome}
        if reason:
            tags[REASON_TAG] = reason[:5000]
        self.set_tags(tags)
        self.set_status("FAILED" if outcome == "failed" else "FINISHED")


@dataclass(frozen=True)
class Tracker:
    """One tracking store and experiment (:func:`connect`): the runs quantlab
    starts there and every search it makes."""

    client: MlflowClient
    experiment_id: str
    _items: dict = field(default_factory=dict, compare=False, repr=False)  # run id -> its items, read once

    def run(self, run_id: str) -> Run:
        return Run(self, run_id)

    @retry
    def get(self, run_id: str):
        return self.client.get_run(run_id)

    def start(self, name: str, tags: dict[str, str], parent: str | None = None,
              params: dict[str, str] | None = None) -> Run:
        """A RUNNING run owned by this process (host/pid tags let a later
        sweep recognise it as dead after a kill -9), under sweep ``parent``.

        Exactly one run: a create whose answer was lost (a tracking server
        restarted while it replied) is sent again, by MLflow's client or by
        :func:`retry`, and makes a second run. The call's own key tag, the same
        in every try, finds such twins; they are deleted."""
        me = psutil.Process()
        key = uuid.uuid4().hex
        tags = {**tags, HOST_TAG: socket.gethostname(), PID_TAG: str(me.pid),
                PID_START_TAG: tracking_server.process_stamp(me), CREATE_KEY_TAG: key}
        if parent:
            tags[PARENT_TAG] = parent
        created = self._create(name, tags)
        self._delete_twins(created, key)
        run = Run(self, created)
        run.log_params(params or {})
        return run

    @retry
    def _create(self, name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    @retry
    def _delete_twins(self, run_id: str, key: str) -> None:
        for twin in self._search(f"tags.`{CREATE_KEY_TAG}` = '{key}'", max_results=100):
            if twin.info.run_id != run_id:
                log.warning("run %s: a create sent again made a twin %s; deleted", run_id, twin.info.run_id)
                self.client.delete_run(twin.info.run_id)

    def _search(self, filter_string: str, newest_first: bool = False, max_results: int = 5000) -> list:
        order = ["attributes.start_time DESC"] if newest_first else None
        return self.client.search_runs([self.experiment_id], filter_string=filter_string, order_by=order,
                                       max_results=max_results)

    @retry
    def children(self, parent: str) -> list:
        return sorted(self._search(f"tags.`{PARENT_TAG}` = '{parent}'"), key=lambda r: r.info.start_time)

    def sweep_runs(self, parent: str) -> tuple[list, list]:
        """A sweep's child runs: those it ran, and the light runs standing for the
        earlier runs it reused (see :meth:`link_reused`)."""
        runs = self.children(parent)
        own = [r for r in runs if REUSED_FROM_TAG not in r.data.tags]
        return own, [r for r in runs if REUSED_FROM_TAG in r.data.tags]

    @retry
    def sweeps(self) -> list[tuple[str, dict[str, str]]]:
        """Every sweep's parent run id and tags, newest first."""
        runs = self._search(f"tags.`{ROLE_TAG}` = '{ROLE_SWEEP}'", newest_first=True, max_results=1000)
        return [(r.info.run_id, dict(r.data.tags)) for r in runs]

    @retry
    def last_sweep(self, sweep: str):
        """The newest parent run of the sweep named ``sweep`` (MLflow's ``Run``), or None."""
        runs = self._search(f"tags.`{ROLE_TAG}` = '{ROLE_SWEEP}' AND tags.`{SWEEP_TAG}` = '{sweep}'",
                            newest_first=True, max_results=1)
        return runs[0] if runs else None

    @retry
    def top_level(self) -> list[tuple[str, dict[str, str]]]:
        """The runs under no parent and their tags, newest first: every sweep
        parent, and the points run alone among the newest 1,000 runs."""
        recent = self._search("", newest_first=True, max_results=1000)
        alone = [r for r in recent if PARENT_TAG not in r.data.tags and r.data.tags.get(ROLE_TAG) != ROLE_SWEEP]
        sweeps = self._search(f"tags.`{ROLE_TAG}` = '{ROLE_SWEEP}'", newest_first=True, max_results=1000)
        both = sorted([*alone, *sweeps], key=lambda r: r.info.start_time, reverse=True)
        return [(r.info.run_id, dict(r.data.tags)) for r in both]

    def find_sweep(self, sweep: str) -> str:
        """The parent run id of ``sweep`` (latest, a sweep name, or a parent run
        id); UserError listing the sweeps there are when none matches."""
        try:
            return find_sweep(self.sweeps(), sweep)[0]
        except LookupError as e:
            raise UserError(str(e)) from None

    def tags(self, run_id: str) -> dict[str, str] | None:
        """A run's tags, or None when the store has no such run."""
        try:
            return dict(self.get(run_id).data.tags)
        except MlflowException:
            return None

    def link_reused(self, parent: str, earlier, sweep: str) -> Run:
        """A light child run under ``parent`` for the ``earlier`` finished run a
        sweep reuses: same name, params, metrics and tags (the sweep's own name,
        outcome ``reused`` and ``quantlab.reused_from`` = the earlier run), so the
        sweep's parent shows every point in the MLflow UI and its tag filter finds
        them all. Artifacts stay with the earlier run (:func:`origin`)."""
        own = ("mlflow.", PARENT_TAG, HASH_TAG, OUTCOME_TAG, REASON_TAG, SWEEP_TAG, HOST_TAG, PID_TAG, PID_START_TAG,
               recommended_point_tag(0).rsplit(".", 1)[0] + ".")  # the sweep's picks stay with that sweep
        tags = {k: v for k, v in earlier.data.tags.items() if not k.startswith(own)}
        tags.update({SWEEP_TAG: sweep, OUTCOME_TAG: "reused", REUSED_FROM_TAG: earlier.info.run_id})
        run = self.start(earlier.info.run_name, tags, parent=parent, params=dict(earlier.data.params))
        run.log_metrics({k: v for k, v in earlier.data.metrics.items() if not k.startswith("recovery/")})
        run.set_status("FINISHED")
        return run

    @retry
    def find_finished(self, point_hash: str, host_id: str | None = None):
        """The newest successfully finished run of this point (measured on host
        ``host_id`` when given), or None."""
        host = f" and tags.`{HOST_ID_TAG}` = '{host_id}'" if host_id else ""
        runs = self._search(f"tags.`{HASH_TAG}` = '{point_hash}' and attributes.status = 'FINISHED' "
                            f"and tags.`{OUTCOME_TAG}` = 'finished'{host}", newest_first=True, max_results=1)
        return runs[0] if runs else None

    @retry
    def find_running(self, point_hash: str, parent: str | None, status: str = "RUNNING"):
        """The newest run of this point in ``status`` under ``parent`` (any
        parent when None), or None."""
        under = f" and tags.`{PARENT_TAG}` = '{parent}'" if parent else ""
        runs = self._search(f"tags.`{HASH_TAG}` = '{point_hash}' and attributes.status = '{status}'{under}",
                            newest_first=True, max_results=1)
        return runs[0] if runs else None

    @retry
    def reap_dead(self) -> list[str]:
        """Mark RUNNING runs whose process died (kill -9, OOM killer) as KILLED."""
        reaped = []
        for found in self._search("attributes.status = 'RUNNING'"):
            if not _alive(found.data.tags):
                run = self.run(found.info.run_id)
                run.set_tags({OUTCOME_TAG: "killed", REASON_TAG: "owning process died (killed or out of memory)"})
                run.set_status("KILLED")
                reaped.append(run.id)
        return reaped

    def items(self, run_id: str) -> dict[str, list[float]]:
        """A run's per-item values (``items.json``); empty when it logged none.
        For a light run of a reused point, pass :func:`origin` (the items stay there).
        Read once per tracker: a point logs its items once, at its end (the
        re-timing and the report after a sweep both read them)."""
        if run_id not in self._items:
            path = self.download(run_id, ITEMS_ARTIFACT)
            if path is None:  # none logged (yet): asked again next time
                return {}
            self._items[run_id] = json.loads(path.read_text())
        return self._items[run_id]

    def download(self, run_id: str, name: str, into: Path | None = None) -> Path | None:
        """The run's artifact ``name`` in ``into`` (default: a fresh temporary
        directory), or None when it has none; without MLflow's download bar
        (a bar per point's small file, as a report reads them, is noise)."""
        was = os.environ.get(_BAR)
        os.environ[_BAR] = "false"
        try:
            return self._download(run_id, name, into or Path(tempfile.mkdtemp(prefix="quantlab-artifact-")))
        except MlflowException:
            return None
        finally:
            if was is None:
                os.environ.pop(_BAR, None)
            else:
                os.environ[_BAR] = was

    @retry
    def _download(self, run_id: str, name: str, into: Path) -> Path:
        return Path(self.client.download_artifacts(run_id, name, str(into)))

    @retry(resend=False)  # a version created twice would be two versions
    def register(self, name: str, source: str, run_id: str, tags: dict[str, str]):
        """A new version of registered model ``name`` (created if new) from
        artifact URI ``source`` of run ``run_id``."""
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if "already exists" not in str(e).lower() and e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return self.client.create_model_version(name, source, run_id=run_id, tags=tags)


_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def _alive(tags: dict[str, str]) -> bool:
    """Whether the process that owns a RUNNING run still exists. Runs owned by
    another host are assumed alive (nothing here can tell)."""
    if tags.get(HOST_TAG) != socket.gethostname() or PID_TAG not in tags:
        return True
    try:
        return tracking_server.same_process(int(tags[PID_TAG]), tags.get(PID_START_TAG, "")) is not None
    except ValueError:
        return False


@functools.cache
def git_commit() -> str:
    """Commit of the quantlab checkout (``+dirty`` when modified); ``not a git
    checkout`` for an installed or copied tree, ``unknown`` without git. Git's
    own messages never reach the console."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return "not a git checkout"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def versions(packages: Iterable[str] = ("torch", "transformers", "torchao", "mlflow", "quantlab")) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in packages:
        try:
            out[f"version.{p}"] = version(p)
        except PackageNotFoundError:
            out[f"version.{p}"] = "absent"
    return out
