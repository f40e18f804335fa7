"""Reading which runs a store holds, fast: the lookups a command makes before
it does any work (which sweep or point to report or export, a run's tags), so
that a name that is not there is refused in one line within a second, before
MLflow, torch or the model load.

A local ``sqlite:///`` store is read with :mod:`sqlite3` alone (its tables as
MLflow 3 writes them, read-only: nothing is created); any other URI, or a
SQLite file of another schema, through :class:`quantlab.tracking.Tracker`,
which answers the same :class:`Store` calls.
"""
from __future__ import annotations

import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Protocol

from quantlab.errors import UserError
from quantlab.point import PARENT_TAG, ROLE_SWEEP, ROLE_TAG

NEWEST = 1000  # how many of the newest runs are searched for points run alone (as Tracker.top_level)
_A_SWEEP = " AND EXISTS (SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = ? AND t.value = ?)"


class Store(Protocol):
    """What the launch-time lookups read."""

    def tags(self, run_id: str) -> dict[str, str] | None:
        """A run's tags; None when the store has no such (active) run."""

    def sweeps(self) -> list[tuple[str, dict[str, str]]]:
        """Every sweep's parent run id and tags, newest first."""

    def top_level(self) -> list[tuple[str, dict[str, str]]]:
        """The runs under no parent, newest first: sweep parents and the points
        run alone among the newest :data:`NEWEST` runs."""


class SqliteStore:
    """A local MLflow SQLite store read with :mod:`sqlite3` (no MLflow import:
    about a second saved on a cold interpreter). Refuses, in one line, a file
    that is not there or an experiment the store lacks; raises
    :class:`sqlite3.Error` for a schema it does not know."""

    def __init__(self, path: Path, experiment: str):
        if not path.is_file():
            raise UserError(f"no tracking store at {path} (run a sweep first, or pass --tracking-uri)")
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        row = self.db.execute("SELECT experiment_id FROM experiments WHERE name = ? AND lifecycle_stage = 'active'",
                              (experiment,)).fetchone()
        if row is None:
            raise UserError(f"no experiment {experiment!r} in {path}")
        self.experiment_id = str(row[0])

    def tags(self, run_id: str) -> dict[str, str] | None:
        if self.db.execute("SELECT 1 FROM runs WHERE run_uuid = ? AND lifecycle_stage = 'active'",
                           (run_id,)).fetchone() is None:
            return None
        return dict(self.db.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)).fetchall())

    def _runs(self, where: str, args: tuple) -> list[tuple[str, int, dict[str, str]]]:
        """``(run id, start time, tags)`` of the active runs of the experiment
        that ``where`` selects, newest first, at most :data:`NEWEST`; the tags
        read in one query."""
        runs = self.db.execute(
            f"SELECT r.run_uuid, r.start_time FROM runs r WHERE r.experiment_id = ? AND r.lifecycle_stage = 'active'"
            f"{where} ORDER BY r.start_time DESC LIMIT {NEWEST}", (self.experiment_id, *args)).fetchall()
        tags: dict[str, dict[str, str]] = defaultdict(dict)
        ids = [i for i, _ in runs]
        for start in range(0, len(ids), 500):  # SQLite's bound on host parameters a statement
            chunk = ids[start:start + 500]
            for run_id, key, value in self.db.execute(
                    f"SELECT run_uuid, key, value FROM tags WHERE run_uuid IN ({','.join('?' * len(chunk))})", chunk):
                tags[run_id][key] = value
        return [(i, t, tags[i]) for i, t in runs]

    def sweeps(self) -> list[tuple[str, dict[str, str]]]:
        return [(i, tags) for i, _, tags in self._runs(_A_SWEEP, (ROLE_TAG, ROLE_SWEEP))]

    def top_level(self) -> list[tuple[str, dict[str, str]]]:
        alone = [(i, t, tags) for i, t, tags in self._runs("", ())
                 if PARENT_TAG not in tags and tags.get(ROLE_TAG) != ROLE_SWEEP]
        both = sorted([*alone, *self._runs(_A_SWEEP, (ROLE_TAG, ROLE_SWEEP))], key=lambda run: run[1], reverse=True)
        return [(i, tags) for i, _, tags in both]


def open_store(uri: str, experiment: str) -> Store:
    """The store the lookups read: a SQLite file directly, any other URI (or a
    SQLite file of a schema :class:`SqliteStore` does not know) through
    :class:`quantlab.tracking.Tracker`."""
    if uri.startswith("sqlite:///"):
        try:
            return SqliteStore(Path(uri[len("sqlite:///"):]), experiment)
        except sqlite3.Error:  # not the schema we read: the slower, general path
            pass
    from quantlab import tracking
    from quantlab.tracking_config import TrackingConfig

    return tracking.connect(TrackingConfig(uri=uri, experiment=experiment, artifact_root=None))
