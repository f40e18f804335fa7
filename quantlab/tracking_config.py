"""Where a sweep logs (the ``tracking`` node) and the one check of a
tracking URI at launch: a database whose driver is not installed is refused
in one line, not when the first point opens the store."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Optional


DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"


def default_tracking_uri() -> str:
    """The store every quantlab command uses when none is given: MLflow's own
    ``MLFLOW_TRACKING_URI`` where set, else the local SQLite file under
    ``mlruns/`` (conf/tracking/local.yaml reads the same variable)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


@dataclass
class TrackingConfig:
    """Where runs go. ``uri`` is any MLflow tracking URI (sqlite file, server);
    every command's default is :func:`default_tracking_uri`.
    ``serve``: where a server quantlab starts keeps its store, when ``uri`` is
    ``http://`` on this machine and nothing answers there
    (:mod:`quantlab.tracking_server`); None: never start one.
    ``serve_backend``: that server's database (``postgresql://user@host/db``
    for many writers; the ``postgres`` extra installs the driver); None:
    SQLite ``mlflow.db`` under ``serve``."""

    uri: str = DEFAULT_TRACKING_URI
    artifact_root: Optional[str] = "mlruns/artifacts"
    experiment: str = "quantlab"
    serve: Optional[str] = None
    serve_backend: Optional[str] = None

    def check(self, path: str) -> None:
        _validate_driver(self.uri, f"{path}uri")
        if self.serve_backend:
            _validate_driver(self.serve_backend, f"{path}serve_backend")


# SQLAlchemy driver name -> the module it imports, where they differ
_DRIVER_MODULES = {"mysqldb": "MySQLdb"}


NOT_DATABASES = ("sqlite", "file", "http", "https", "databricks", "databricks-uc", "uc", "mlflow-artifacts")


def shown_uri(uri: str) -> str:
    """A database URI as a message may show it: no credentials."""
    return re.sub(r"//[^@/]*@", "//***@", uri)


def _validate_driver(uri: str, name: str) -> None:
    """A database tracking URI (``dialect[+driver]://``) whose driver is not
    installed is refused here, not as a ``ModuleNotFoundError`` when the first
    point opens the store. The plain ``postgresql://`` form gets the driver
    the installed SQLAlchemy picks for it (psycopg 3 from SQLAlchemy 2.1,
    psycopg2 before); ``quantlab[postgres]`` installs both."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if not scheme or scheme.split("+")[0] in NOT_DATABASES:
        return
    from sqlalchemy.dialects import registry
    from sqlalchemy.exc import NoSuchModuleError

    try:
        dialect = registry.load(scheme.replace("+", "."))
    except NoSuchModuleError:
        raise ValueError(f"{name}={shown_uri(uri)}: unknown database dialect {scheme!r} (MLflow's stores: sqlite:///, "
                         "postgresql://, mysql://, mssql://, or http(s):// for a server)") from None
    module = _DRIVER_MODULES.get(dialect.driver, dialect.driver)
    if importlib.util.find_spec(module) is None:
        install = "pip install 'quantlab[postgres]'" if scheme.startswith("postgresql") else f"pip install {module}"
        raise ValueError(f"{name}={shown_uri(uri)}: needs the {module} driver, which is not installed ({install})")
