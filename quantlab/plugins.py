"""Extension points: classes registered under an entry-point group
(``quantlab.probes``, ``quantlab.probe_specs``, ``quantlab.schemes``,
``quantlab.targets``), quantlab's
own declared in its pyproject.toml the same way another package declares its
own."""
from __future__ import annotations

from importlib.metadata import entry_points

from quantlab.errors import UserError

PROBES = "quantlab.probes"
PROBE_SPECS = "quantlab.probe_specs"  # light declarations of probes' metrics and settings (quantlab.metric_names)
SCHEMES = "quantlab.schemes"
TARGETS = "quantlab.targets"


def load(group: str) -> dict[str, object]:
    """Name -> the loaded object of every entry point in ``group``. Raises
    UserError naming the entry point when one cannot be imported, when two
    packages register one name, or when quantlab's own are missing (its
    metadata is not installed: ``pip install -e .`` in the checkout)."""
    found: dict[str, object] = {}
    owners: dict[str, str] = {}
    for ep in entry_points(group=group):
        dist = ep.dist.name if ep.dist is not None else "?"
        if ep.name in found:
            if owners[ep.name] == dist:  # one distribution seen twice on sys.path: its first copy wins
                continue
            raise UserError(f"{group} {ep.name!r} is registered by both {owners[ep.name]} and {dist}")
        try:
            found[ep.name] = ep.load()
        except Exception as e:  # noqa: BLE001 - any import error of a plugin is reported in one line
            raise UserError(f"{group} {ep.name!r} ({ep.value}, from {dist}) cannot be loaded: "
                            f"{type(e).__name__}: {e}") from None
        owners[ep.name] = dist
    if "quantlab" not in owners.values():
        raise UserError(f"no {group} from quantlab itself: its package metadata is not installed "
                        "(pip install -e . in the checkout)")
    return found


def bad_value(group: str, name: str, expected: str) -> UserError:
    """The error for an entry point in ``group`` whose object is not ``expected``."""
    return UserError(f"{group} entry point {name!r}: it must name {expected}")


def bad_name(group: str, name: str, expected: str) -> UserError:
    """The error for an entry point in ``group`` whose name is not of the form ``expected``."""
    return UserError(f"{group} entry point {name!r}: its name must be {expected}")
