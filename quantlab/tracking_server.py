"""A tracking server for the sweep when ``tracking=server`` names this
machine and nothing answers there.

Points on Ray workers (or joblib workers) must not share a file store: each
would open the SQLite file itself ("database is locked" under concurrent
writers). With a server, the server process is the only writer and workers
log over HTTP. ``tracking.serve`` (default ``mlruns/server`` in the
``server`` preset) is where a server quantlab starts keeps its store
(``mlflow.db``) and the artifacts it serves (``artifacts/``); the server runs
for the command's lifetime in its own process group and is stopped with it.
A URI naming another host is never started, only checked
(:func:`quantlab.tracking.connect`); ``tracking.serve=null`` never starts one.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from quantlab.config import TrackingConfig
from quantlab.errors import UserError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


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


def command(uri: str, root: Path) -> list[str]:
    """``mlflow server`` for ``uri``'s host and port with its store under ``root``."""
    u = urlparse(uri)
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", (root / "artifacts").as_uri(), "--serve-artifacts",
            "--host", u.hostname or "127.0.0.1", "--port", str(u.port or 80), "--workers", "1"]


@contextlib.contextmanager
def ensure(cfg: TrackingConfig, timeout_s: float = 120.0) -> Iterator[subprocess.Popen | None]:
    """Within the block, ``cfg.uri`` answers: already (yields None), or from a
    server started here under ``cfg.serve`` (yields its process, stopped on
    leaving the block, also on an exception or ``sys.exit``). Raises
    UserError in one line when the server exits or stays silent at start."""
    u = urlparse(cfg.uri)
    if not cfg.serve or u.scheme != "http" or u.hostname not in LOCAL_HOSTS or not unreachable(cfg.uri):
        yield None
        return
    root = Path(cfg.serve).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    logfile = root / "server.log"
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(command(cfg.uri, root), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while unreachable(cfg.uri):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (logfile.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
                why = f"exited with status {proc.returncode}" if proc.poll() is not None \
                    else f"did not answer within {timeout_s:.0f} s"
                raise UserError(f"tracking server at {cfg.uri} (started here, store {root}) {why}: {tail}")
            time.sleep(0.5)
        print(f"quantlab: started an MLflow tracking server at {cfg.uri} (store {root}, log {logfile}); it stops "
              f"with this command. Browse later: mlflow ui --backend-store-uri sqlite:///{root / 'mlflow.db'}",
              file=sys.stderr, flush=True)
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop the server and its workers (its whole process group)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
