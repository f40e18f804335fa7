"""``python -m quantlab <command> ...`` is the ``quantlab`` CLI
(:mod:`quantlab.console`); ``python -m quantlab <overrides>`` (no command)
runs a sweep or a point, as ``quantlab run`` does."""
import sys

from quantlab.console import COMMANDS

if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
    from quantlab.console import main
else:
    from quantlab.cli import main

raise SystemExit(main())
