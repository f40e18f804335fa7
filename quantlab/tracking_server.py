"""A tracking server for the sweep when ``tracking=server`` names this
machine and nothing answers there.

Points on Ray workers (or joblib workers) must not share a file store: each
would open the SQLite file itself ("database is locked" under concurrent
writers). With a server, the server process is the only writer and workers
log over HTTP. ``tracking.serve`` (default ``mlruns/server`` in the
``server`` preset) is where a server quantlab starts keeps its store
(``mlflow.db``) and the artifacts it serves (``artifacts/``); the server runs
for the command's lifetime in its own process group and is stopped with it;
if it dies meanwhile it is restarted on the same port and store (one line
says so; points waiting for it go on). A port another process holds is named
in one line before anything starts.
A server whose command was killed (kill -9 of the driver: nothing could stop
it) is adopted by the next command that finds it at the same URI and store
(``server.json`` there names it and its owner), and stopped with that one.
A URI naming another host is never started, only checked
(:func:`quantlab.tracking.connect`); ``tracking.serve=null`` never starts one.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import psutil

from quantlab import ports
from quantlab.tracking_config import TrackingConfig, shown_uri
from quantlab.errors import UserError

log = logging.getLogger("quantlab")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
OWNER_FILE = "server.json"  # under tracking.serve: the server quantlab started there, and its command


def unreachable(uri: str, timeout_s: float = 2.0) -> str:
    """'' when something answers HTTP at ``uri`` (an error status counts: a
    proxy, or an older server without ``/health``), else why not."""
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s)
    except urllib.error.HTTPError:
        return ""
    except OSError as e:
        return str(getattr(e, "reason", e))
    return ""


def store_unusable(uri: str, timeout_s: float = 2.0) -> str:
    """'' when a file or database store at ``uri`` can be used, else why not,
    before anything heavy is imported: a SQLite file's directory exists or is
    made now (as the first point would make it; nothing else is written); a
    database's host and port answer a TCP connect within ``timeout_s``
    (MLflow itself retries for minutes). Servers (``http``) are
    :func:`unreachable`'s."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme == "sqlite":
        folder = Path(uri[len("sqlite:///"):]).expanduser().absolute().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot create {folder}: {e.strerror}"
        return ""
    if not scheme or scheme.split("+")[0] in ("file", "http", "https", "databricks", "databricks-uc", "uc",
                                              "mlflow-artifacts"):
        return ""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(uri)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's parse errors vary by version: one line
        return f"not a database URI ({type(e).__name__})"
    if not url.host:  # a local socket, or SQLite-like: the driver decides
        return ""
    port = url.port or {"postgresql": 5432, "mysql": 3306, "mssql": 1433}.get(url.get_backend_name())
    if port is None:
        return ""
    if why := ports.connect_error(url.host, port, timeout_s):
        return f"the database does not answer at {url.host}:{port} ({why}); start it or fix the URI"
    return ""


def refused(uri: str, why: str, waited_s: float = 0.0) -> UserError:
    """The one line for a tracking server that does not answer (after
    ``waited_s`` of waiting, or at once)."""
    hint = f" for {waited_s:.0f} s" if waited_s else \
        " (is the URI right? a server on this machine can be started by quantlab: tracking.serve=<dir>)"
    return UserError(f"tracking store {uri} unusable: server unreachable ({why}){hint}")


def command(uri: str, root: Path, backend: str | None = None) -> list[str]:
    """``mlflow server`` for ``uri``'s host and port, its served artifacts
    under ``root``, its runs in ``backend`` (a database URI; None: SQLite
    ``root/mlflow.db``)."""
    u = urlparse(uri)
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend or f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", (root / "artifacts").as_uri(), "--serve-artifacts",
            "--host", u.hostname or "127.0.0.1", "--port", str(u.port or 80), "--workers", "1"]


@contextlib.contextmanager
def ensure(cfg: TrackingConfig, timeout_s: float = 120.0) -> Iterator[subprocess.Popen | None]:
    """Within the block, ``cfg.uri`` answers: already (yields None; a server
    a killed command started under ``cfg.serve`` is adopted and stopped on
    leaving), or from a server started here under ``cfg.serve`` (yields its
    process, stopped on leaving the block, also on an exception or
    ``sys.exit``). Raises UserError in one line when the server exits or
    stays silent at start, when its port is held by another process, or when
    a server quantlab does not start (``tracking.serve=null``, another host)
    does not answer."""
    for uri, what in ((cfg.uri, "tracking store"), (cfg.serve_backend, "tracking.serve_backend")):
        if uri and (why := store_unusable(uri)):
            raise UserError(f"{what} {shown_uri(uri)} unusable: {why}")
    u = urlparse(cfg.uri)
    if not cfg.serve or u.scheme != "http" or u.hostname not in LOCAL_HOSTS:
        if u.scheme in ("http", "https") and (why := unreachable(cfg.uri)):
            raise refused(cfg.uri, why)  # before anything is imported or started: a wrong URI is one line
        yield None
        return
    root = Path(cfg.serve).expanduser().resolve()
    if not unreachable(cfg.uri):
        left = orphan(root, cfg.uri)
        if left is not None:
            print(f"quantlab: adopting the tracking server at {cfg.uri} (pid {left.pid}) that a killed quantlab "
                  "command started; it stops with this one", file=sys.stderr, flush=True)
            _own(root, cfg.uri, left)
        try:
            yield None
        finally:
            if left is not None:
                stop(left.pid)
        return
    root.mkdir(parents=True, exist_ok=True)
    if why := ports.unavailable(u.hostname, u.port or 80):
        raise UserError(f"tracking server at {cfg.uri} cannot start: port {u.port or 80} {why} (stop it, or choose "
                        "another port in tracking.uri)")
    logfile = root / "server.log"
    keeper = _Keeper(cfg, root, logfile)
    try:
        proc = keeper.start()
        deadline = time.monotonic() + timeout_s
        while unreachable(cfg.uri):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (logfile.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
                why = f"exited with status {proc.returncode}" if proc.poll() is not None \
                    else f"did not answer within {timeout_s:.0f} s"
                raise UserError(f"tracking server at {cfg.uri} (started here, store {root}) {why}: {tail}")
            time.sleep(0.5)
        store = cfg.serve_backend or f"sqlite:///{root / 'mlflow.db'}"
        print(f"quantlab: started an MLflow tracking server at {cfg.uri} (runs in {shown_uri(store)}, artifacts and log "
              f"under {root}); it stops with this command. Browse later: mlflow ui --backend-store-uri "
              f"{shown_uri(store)}", file=sys.stderr, flush=True)
        keeper.watch()
        yield proc
    finally:
        keeper.close()
        (root / OWNER_FILE).unlink(missing_ok=True)


class _Keeper:
    """The server quantlab started, kept alive for the command's lifetime: a
    watcher thread restarts it (same command: same port and store) each time
    it dies, with one line saying so; clients waiting for it
    (:data:`quantlab.tracking.SERVER_WAIT_S`) then go on. A server that dies
    again before answering is not restarted a further time."""

    POLL_S = 1.0

    def __init__(self, cfg: TrackingConfig, root: Path, logfile: Path):
        self.cfg, self.root, self.logfile = cfg, root, logfile
        self.proc: subprocess.Popen | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> subprocess.Popen:
        with open(self.logfile, "ab") as out:
            self.proc = subprocess.Popen(command(self.cfg.uri, self.root, self.cfg.serve_backend), stdout=out,
                                         stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        _own(self.root, self.cfg.uri, psutil.Process(self.proc.pid))
        return self.proc

    def watch(self) -> None:
        self._thread = threading.Thread(target=self._run, name="quantlab-tracking-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        answered = True  # the first server answered before watch() was called
        while not self._done.wait(self.POLL_S):
            with self._lock:
                if self._done.is_set():
                    return
                if self.proc.poll() is None:
                    answered = answered or not unreachable(self.cfg.uri, 0.5)
                    continue
                old, status = self.proc.pid, self.proc.returncode
                stop(old)  # its workers too: one left holding the port would stop the new server binding it
                if not answered:
                    print(f"quantlab: the tracking server at {self.cfg.uri} (pid {old}) died again before answering "
                          f"(status {status}); not restarting it (see {self.logfile})", file=sys.stderr, flush=True)
                    return
                new = self.start()
                answered = False
                print(f"quantlab: the tracking server at {self.cfg.uri} (pid {old}) died (status {status}); restarted "
                      f"it on the same port and store (pid {new.pid})", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop watching, then stop the server (the current one after a restart)."""
        with self._lock:
            self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.proc is not None:
            stop(self.proc.pid)
            self.proc.wait()


def _own(root: Path, uri: str, server: psutil.Process) -> None:
    """Record ``server`` (at ``uri``) as started for this process."""
    me = psutil.Process()
    (root / OWNER_FILE).write_text(json.dumps({"uri": uri, "pid": server.pid, "start": process_stamp(server),
                                               "owner": me.pid, "owner_start": process_stamp(me)}))


def process_stamp(proc: psutil.Process) -> str:
    """A process's start time as quantlab records it (with its pid, it names
    the process: a pid reused by a later process has another stamp)."""
    return f"{proc.create_time():.3f}"


def same_process(pid: int, stamp: str) -> psutil.Process | None:
    """The process ``pid`` if it is still the one :func:`process_stamp` stamped ``stamp``."""
    try:
        proc = psutil.Process(pid)
        return proc if process_stamp(proc) == stamp else None
    except psutil.NoSuchProcess:
        return None


def orphan(root: Path, uri: str) -> psutil.Process | None:
    """The server quantlab started at ``uri`` under ``root`` whose command is
    gone (killed before it could stop it), or None."""
    try:
        rec = json.loads((root / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if rec.get("uri") != uri or same_process(rec["owner"], rec["owner_start"]) is not None:
        return None
    return same_process(rec["pid"], rec["start"])


def stop(pid: int, timeout_s: float = 30.0) -> None:
    """Stop a server and its workers (its whole process group: the server
    leads it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        try:
            psutil.Process(pid).wait(timeout=timeout_s)
            return
        except psutil.NoSuchProcess:
            return
        except psutil.TimeoutExpired:
            continue
