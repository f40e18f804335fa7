"""``quantlab COMMAND ...``: one command line for every quantlab tool.

    quantlab run [+sweep=NAME] [group=option ...]   sweeps and points (python -m quantlab)
    quantlab report [--sweep latest] ...            a sweep's report and picks (python -m quantlab.report)
    quantlab export --sweep latest --out DIR        the chosen point as a checkpoint or GGUF
    quantlab capabilities                           which scheme runs where, on this machine
    quantlab sensitivity --model NAME ...           per-layer sensitivity and mixed recipes

Each command's ``--help`` lists its options (``quantlab run --help``: Hydra's).
The ``python -m`` forms stay. Every command reads the same tracking store:
``MLFLOW_TRACKING_URI`` where set, else ``sqlite:///mlruns/mlflow.db``
(``tracking.uri=`` or ``--tracking-uri`` win).
"""
from __future__ import annotations

import importlib
import sys

# command -> (module with main(argv, prog) -> exit status, one line of help)
COMMANDS = {
    "run": ("quantlab.cli", "run a sweep or a point (Hydra overrides)"),
    "report": ("quantlab.report_cli", "a sweep's report, Pareto plot and picks"),
    "export": ("quantlab.export_cli", "export a point as a checkpoint or a GGUF file"),
    "capabilities": ("quantlab.capabilities", "which scheme runs on which target, here"),
    "sensitivity": ("quantlab.sensitivity", "per-layer sensitivity and mixed-precision recipes"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: quantlab COMMAND [ARGS ...]\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command's own ``main``; exit status 2 with the list of
    commands for an unknown one (or none)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"quantlab: unknown command {name!r}; valid: {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"quantlab {name}") or 0


if __name__ == "__main__":
    raise SystemExit(main())
